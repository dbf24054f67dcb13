# Sourced by the quick-start scripts. Under sudo, builds run as the user who ran sudo: no
# compiler or build script runs as root from their tree, and no root-owned file is left in it.
# Only what needs root (installing packages, tracing, the tests that trace) runs as root.

# True when root was reached through sudo by another user.
invoked_through_sudo() {
  [ "$(id -u)" -eq 0 ] && [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ]
}

# Runs "$@" as the invoking user (with their home and toolchain), or as is when not under sudo.
as_user() {
  if invoked_through_sudo; then
    local home
    home=$(getent passwd "$SUDO_USER" | cut -d: -f6)
    runuser -u "$SUDO_USER" -- env HOME="$home" USER="$SUDO_USER" \
      PATH="$home/.cargo/bin:/usr/local/bin:/usr/bin:/bin" CI="${CI:-}" "$@"
  else
    "$@"
  fi
}
