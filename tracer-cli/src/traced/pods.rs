//! Which Kubernetes pod and container a process runs in: the pod UID and container ID from its
//! cgroup path (systemd and cgroupfs drivers, containerd, CRI-O and Docker naming, paths seen
//! from inside a cgroup namespace), and the pod's namespace and name from the Kubernetes API,
//! looked up on a thread of its own and cached, so the event path never waits for it.

use std::{
    collections::{HashMap, HashSet},
    path::PathBuf,
    sync::{
        mpsc::{self, Receiver, SyncSender},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use crate::model::figures::PodRef;

/// The pod UID and container ID in a process's /proc/PID/cgroup text, if it runs in a pod.
pub fn pod_of(cgroup: &str) -> Option<PodRef> {
    // cgroup v2 has one line ("0::/path"); v1 one per hierarchy: any that names the pod.
    cgroup.lines().find_map(|line| {
        let path = line.splitn(3, ':').nth(2)?;
        pod_of_path(path)
    })
}

fn pod_of_path(path: &str) -> Option<PodRef> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let (at, pod_uid) = parts
        .iter()
        .enumerate()
        .find_map(|(i, p)| pod_uid_of(p).map(|uid| (i, uid)))?;
    let container_id = parts[at + 1..]
        .iter()
        .rev()
        .find_map(|p| container_id_of(p));
    Some(PodRef {
        pod_uid,
        container_id,
    })
}

/// `pod<uid>` (cgroupfs driver) or `kubepods-<qos>-pod<uid with _>.slice` (systemd driver).
fn pod_uid_of(part: &str) -> Option<String> {
    let part = part.strip_suffix(".slice").unwrap_or(part);
    let start = part.rfind("pod")? + 3;
    let prefix = &part[..start - 3];
    if !(prefix.is_empty() || prefix.starts_with("kubepods") && prefix.ends_with('-')) {
        return None;
    }
    let uid = part[start..].replace('_', "-");
    let is_uid = uid.len() == 36
        && uid.char_indices().all(|(i, c)| {
            if [8, 13, 18, 23].contains(&i) {
                c == '-'
            } else {
                c.is_ascii_hexdigit()
            }
        });
    is_uid.then_some(uid)
}

/// `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope` (systemd driver) or a
/// bare `<id>` / `crio-<id>` (cgroupfs driver): a 64-digit hex ID. CRI-O's `crio-conmon-`
/// monitor is not the container.
fn container_id_of(part: &str) -> Option<String> {
    let part = part.strip_suffix(".scope").unwrap_or(part);
    let id = ["cri-containerd-", "crio-", "docker-", "containerd-", ""]
        .iter()
        .find_map(|prefix| part.strip_prefix(prefix))?;
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_owned())
}

/// A pod's names, as the API gave them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodName {
    pub namespace: String,
    pub name: String,
    /// Container ID (without the runtime's `containerd://` scheme) to container name.
    pub containers: HashMap<String, String>,
    /// The job it is a part of (its JobSet, training job or owning controller:
    /// `model::job::pod_owner`), where it is one.
    pub job: Option<String>,
}

/// Where to find the Kubernetes API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KubeSource {
    /// In-cluster configuration (the pod's service account), when tracer runs in a pod.
    InCluster,
    /// A kubeconfig file (outside a cluster, and tests).
    Kubeconfig(PathBuf),
    Off,
}

/// The pods' names, looked up as UIDs are asked for.
pub struct PodDirectory {
    names: Arc<Mutex<HashMap<String, PodName>>>,
    asks: Option<SyncSender<String>>,
    asked: Mutex<HashSet<String>>,
    state: Arc<Mutex<String>>,
}

/// Pod UIDs waiting for a lookup; more are dropped (asked again at the next sighting).
const ASKS_QUEUED: usize = 256;
/// Pods whose names are kept (a node runs far fewer at once).
const PODS_KEPT: usize = 4096;
/// At most one pod list per this long.
const LIST_INTERVAL: Duration = Duration::from_secs(5);
/// A lookup that takes longer is abandoned.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

impl PodDirectory {
    /// A directory with no lookups: pods are known by UID only.
    pub fn off() -> PodDirectory {
        PodDirectory {
            names: Arc::default(),
            asks: None,
            asked: Mutex::default(),
            state: Arc::new(Mutex::new("off".into())),
        }
    }

    /// Starts the lookup thread, unless `source` is off or no in-cluster configuration exists.
    pub fn start(source: KubeSource) -> PodDirectory {
        let mut directory = PodDirectory::off();
        if source == KubeSource::Off
            || source == KubeSource::InCluster
                && std::env::var_os("KUBERNETES_SERVICE_HOST").is_none()
        {
            return directory;
        }
        let (tx, rx) = mpsc::sync_channel(ASKS_QUEUED);
        let names = Arc::clone(&directory.names);
        let state = Arc::clone(&directory.state);
        set(&state, "starting");
        let spawned = std::thread::Builder::new()
            .name("tracer-pods".into())
            .spawn(move || {
                if let Err(e) = look_up(&source, &rx, &names, &state) {
                    set(&state, &format!("off: {e:#}"));
                }
            });
        if spawned.is_ok() {
            directory.asks = Some(tx);
        }
        directory
    }

    /// Asks for a pod's names; never blocks (a full queue drops the ask).
    pub fn want(&self, uid: &str) {
        let Some(asks) = &self.asks else { return };
        if let Ok(mut asked) = self.asked.lock() {
            if asked.len() >= PODS_KEPT {
                asked.clear();
            }
            if asked.insert(uid.to_owned()) && asks.try_send(uid.to_owned()).is_err() {
                asked.remove(uid);
            }
        }
    }

    /// A pod's names, once looked up.
    pub fn name(&self, uid: &str) -> Option<PodName> {
        self.names.lock().ok()?.get(uid).cloned()
    }

    /// How the lookups stand: off, starting, ok, or the last error.
    pub fn state(&self) -> String {
        self.state.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

fn set(state: &Mutex<String>, to: &str) {
    if let Ok(mut s) = state.lock() {
        *s = to.to_owned();
    }
}

/// The lookup thread: lists the node's pods when a UID it does not know is asked for.
fn look_up(
    source: &KubeSource,
    asks: &Receiver<String>,
    names: &Mutex<HashMap<String, PodName>>,
    state: &Mutex<String>,
) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the Kubernetes lookups' runtime")?;
    let client = runtime.block_on(client(source))?;
    // The DaemonSet passes the node's name (downward API): list only this node's pods.
    let node = std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty());
    let mut last_list: Option<Instant> = None;
    set(state, "ok: waiting for a pod to look up");
    while let Ok(uid) = asks.recv() {
        if names.lock().is_ok_and(|n| n.contains_key(&uid)) {
            continue;
        }
        if let Some(at) = last_list {
            std::thread::sleep(LIST_INTERVAL.saturating_sub(at.elapsed()));
        }
        last_list = Some(Instant::now());
        match runtime.block_on(list_pods(&client, node.as_deref())) {
            Ok(listed) => {
                let n = listed.len();
                if let Ok(mut names) = names.lock() {
                    // Bounded over weeks of pods coming and going: the node's pods now.
                    if names.len() + listed.len() > PODS_KEPT {
                        names.clear();
                    }
                    names.extend(listed);
                }
                set(state, &format!("ok: {n} pods listed"));
            }
            Err(e) => set(state, &format!("error: {e:#}")),
        }
    }
    Ok(())
}

async fn client(source: &KubeSource) -> Result<kube::Client> {
    let config = match source {
        KubeSource::Kubeconfig(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading the kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &Default::default())
                .await
                .with_context(|| format!("using the kubeconfig {}", path.display()))?
        }
        _ => kube::Config::incluster().context("reading the in-cluster configuration")?,
    };
    kube::Client::try_from(config).context("making the Kubernetes client")
}

/// GET /api/v1/pods (with spec.nodeName=NODE when known): every pod's UID, names and
/// containers. Read-only: the RBAC in deploy/ grants list on pods and nothing else.
async fn list_pods(client: &kube::Client, node: Option<&str>) -> Result<Vec<(String, PodName)>> {
    use k8s_openapi::api::core::v1::Pod;
    let api: kube::Api<Pod> = kube::Api::all(client.clone());
    let mut params = kube::api::ListParams::default();
    if let Some(node) = node {
        params = params.fields(&format!("spec.nodeName={node}"));
    }
    let pods = tokio::time::timeout(LIST_TIMEOUT, api.list(&params))
        .await
        .context("listing pods: no answer in 10 s")?
        .context("listing pods")?;
    Ok(pods
        .items
        .into_iter()
        .filter_map(|pod| {
            let uid = pod.metadata.uid?;
            let statuses = pod.status.into_iter().flat_map(|s| {
                s.container_statuses
                    .into_iter()
                    .flatten()
                    .chain(s.init_container_statuses.into_iter().flatten())
            });
            let containers = statuses
                .filter_map(|c| {
                    let id = c.container_id?;
                    let bare = id.split_once("://").map_or(id.as_str(), |(_, b)| b);
                    Some((bare.to_owned(), c.name))
                })
                .collect();
            let namespace = pod.metadata.namespace.unwrap_or_default();
            let labels: HashMap<String, String> = pod
                .metadata
                .labels
                .unwrap_or_default()
                .into_iter()
                .collect();
            let owners = pod.metadata.owner_references.unwrap_or_default();
            let controller = owners.iter().find(|o| o.controller == Some(true));
            let job = crate::model::job::pod_owner(
                &namespace,
                &labels,
                controller.map(|o| (o.kind.as_str(), o.name.as_str())),
            );
            Some((
                uid,
                PodName {
                    namespace,
                    name: pod.metadata.name.unwrap_or_default(),
                    containers,
                    job,
                },
            ))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "6f1c2f4e-8f0a-4c7e-9b1d-2a3b4c5d6e7f";
    const ID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn found(cgroup: &str) -> Option<(String, Option<String>)> {
        pod_of(cgroup).map(|p| (p.pod_uid, p.container_id))
    }

    #[test]
    fn every_driver_and_runtime_naming() {
        let systemd_uid = UID.replace('-', "_");
        let cases = [
            // systemd driver, containerd, cgroup v2
            format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{systemd_uid}.slice/cri-containerd-{ID}.scope"),
            // systemd driver, CRI-O, guaranteed QoS
            format!("0::/kubepods.slice/kubepods-pod{systemd_uid}.slice/crio-{ID}.scope"),
            // cgroupfs driver, containerd
            format!("0::/kubepods/besteffort/pod{UID}/{ID}"),
            // cgroupfs driver, CRI-O
            format!("0::/kubepods/burstable/pod{UID}/crio-{ID}"),
            // Docker (cri-dockerd) under systemd
            format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{systemd_uid}.slice/docker-{ID}.scope"),
            // Seen from inside tracer's own cgroup namespace: relative to its root.
            format!("0::/../../kubepods-besteffort-pod{systemd_uid}.slice/cri-containerd-{ID}.scope"),
            // cgroup v1: several hierarchies; one names the pod.
            format!("12:pids:/\n11:memory:/kubepods/burstable/pod{UID}/{ID}\n0::/"),
        ];
        for cgroup in cases {
            assert_eq!(
                found(&cgroup),
                Some((UID.to_owned(), Some(ID.to_owned()))),
                "{cgroup}"
            );
        }
    }

    #[test]
    fn not_in_a_pod_or_not_a_container() {
        assert_eq!(
            found("0::/user.slice/user-1000.slice/session-3.scope"),
            None
        );
        assert_eq!(found("0::/system.slice/docker-{ID}.scope"), None);
        assert_eq!(found("0::/"), None);
        assert_eq!(found(""), None);
        // A pod's own cgroup, no container below it; CRI-O's monitor is no container.
        let systemd_uid = UID.replace('-', "_");
        assert_eq!(
            found(&format!(
                "0::/kubepods.slice/kubepods-pod{systemd_uid}.slice"
            )),
            Some((UID.to_owned(), None))
        );
        assert_eq!(
            found(&format!(
                "0::/kubepods.slice/kubepods-pod{systemd_uid}.slice/crio-conmon-{ID}.scope"
            )),
            Some((UID.to_owned(), None))
        );
        // Something that only looks like a pod segment.
        assert_eq!(found("0::/mypod1234/x"), None);
        assert_eq!(found(&format!("0::/notkube-pod{UID}/{ID}")), None);
    }
}
