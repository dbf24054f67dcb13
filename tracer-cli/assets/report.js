// tracer's report page: draws the data tracer embedded above (no request leaves the page).
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("data").textContent);
  const root = document.getElementById("report");
  const tip = document.getElementById("tip");
  const E = D.explain;

  function el(tag, attrs, ...children) {
    const n = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") n.className = v; else if (k === "text") n.textContent = v; else n.setAttribute(k, v);
    }
    for (const c of children) n.append(c);
    return n;
  }
  const count = (n) => Number(n).toLocaleString("en-US");
  function bytes(n) {
    if (n === null || n === undefined) return "";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = Number(n), u = 0;
    while (Math.abs(v) >= 1024 && u < units.length - 1) { v /= 1024; u++; }
    return (u === 0 ? String(v) : v.toFixed(v >= 100 ? 0 : v >= 10 ? 1 : 2)) + " " + units[u];
  }
  function dur(ns) {
    if (ns < 1e3) return ns + " ns";
    if (ns < 1e6) return (ns / 1e3).toFixed(1) + " us";
    if (ns < 1e9) return (ns / 1e6).toFixed(2) + " ms";
    return (ns / 1e9).toFixed(2) + " s";
  }
  function utc(ns) {
    const d = new Date(Math.floor(ns / 1e6));
    const frac = String(Math.floor(ns % 1e9)).padStart(9, "0").slice(0, 3);
    return d.toISOString().slice(0, 19).replace("T", " ") + "." + frac + " UTC";
  }
  const t0 = E.window.from_ns;
  const rel = (ns) => ((ns - t0) / 1e9).toFixed(3) + " s";
  function table(headers, rows, numeric) {
    const t = el("table");
    t.append(el("tr", {}, ...headers.map((h) => el("th", { text: h }))));
    for (const r of rows) {
      t.append(el("tr", {}, ...r.map((c, i) => el("td", numeric && numeric[i] ? { class: "n", text: c } : { text: c }))));
    }
    return t;
  }
  function section(title, id) {
    const s = el("section", { id: id });
    s.append(el("h2", { text: title }));
    root.append(s);
    return s;
  }
  function showTip(ev, text) {
    tip.textContent = text;
    tip.style.display = "block";
    tip.style.left = Math.min(ev.clientX + 12, window.innerWidth - 320) + "px";
    tip.style.top = ev.clientY + 14 + "px";
  }
  const hideTip = () => { tip.style.display = "none"; };

  // Header.
  root.textContent = "";
  const s = D.session;
  root.append(el("h1", { text: "tracer report: session " + s.id }));
  root.append(el("p", { class: "note", id: "summary",
    text: "Status " + s.status + ", recorded by " + s.source + (s.command ? " (" + s.command + ")" : "") +
      ". Window " + utc(E.window.from_ns) + " to " + utc(E.window.to_ns) + " (" + ((E.window.to_ns - E.window.from_ns) / 1e9).toFixed(3) +
      " s), " + count(E.events_in_window) + " calls in it." }));
  root.append(el("p", { class: "note warn",
    text: "This page holds the traced jobs' process names, command lines, file paths and call sites. Share it as you would their logs." }));
  root.append(el("p", { class: "note", id: "downsampling",
    text: "Charts: " + count(D.calls_read) + " calls read; each point covers " + dur(D.bucket_ns) +
      " (downsampled in tracer: a point shows the highest value in its interval, the largest free block the lowest; latency p50/p99 from a histogram with 4 bins per octave, upper bounds). " +
      "Tables and chains are exact. Devices are numbered as the traced program saw them." }));

  for (const line of D.coverage) {
    root.append(el("p", { class: "note warn coverage", text: line }));
  }

  const lost = D.losses.reduce((a, [, v]) => a + v, 0);
  root.append(el("p", { class: lost === 0 ? "note" : "note warn", id: "lost-line",
    text: lost === 0 ? "tracer kept every event it read (loss counters at the end)." :
      "tracer could not keep " + count(lost) + " events or records: see the loss counters at the end." }));

  // Charts per process and device.
  const chartSec = section("Memory over time", "charts");
  chartSec.append(el("p", { class: "note", text: "Click a memory chart to show the segment map at the nearest moment mapped. Marks: red OOM, orange failed allocation, purple retry, brown early warning." }));
  const markColour = { oom: "#d62728", failed: "#ff7f0e", retry: "#9467bd", warning: "#8c564b" };
  function markerPlugin(pid, device) {
    // A mark whose device is not known (or a line whose device is not known) goes on every
    // line of its process.
    const marks = D.markers.filter((m) => m.pid === pid && (m.device === device || m.device < 0 || device < 0));
    return {
      hooks: {
        draw: [(u) => {
          const ctx = u.ctx;
          ctx.save();
          ctx.lineWidth = 2 * devicePixelRatio;
          for (const m of marks) {
            // An OOM raised just after the last call is drawn at the chart's right edge.
            const x = Math.min(u.valToPos(m.ts_ns / 1e9, "x", true), u.bbox.left + u.bbox.width - 1);
            if (x < u.bbox.left) continue;
            ctx.strokeStyle = markColour[m.kind];
            ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
          }
          ctx.restore();
        }],
      },
    };
  }
  const width = Math.min(1160, window.innerWidth - 40);
  const secs = (l) => l.t.map((t) => t / 1e9);
  const axisBytes = { values: (u, v) => v.map((x) => (x === null ? "" : bytes(x))), size: 80 };
  const timeAxis = { values: (u, v) => v.map((x) => ((x * 1e9 - t0) / 1e9).toFixed(2) + "s") };
  const charts = [];
  for (const line of D.lines) {
    const name = (D.comms[line.pid] || "pid") + " (pid " + line.pid + "), " +
      (line.device < 0 ? "device not known (no cudaSetDevice seen: the current device)" : "device " + line.device);
    chartSec.append(el("h3", { text: name }));
    const box = el("div", { class: "charts" });
    chartSec.append(box);
    const x = secs(line);
    const plugins = [markerPlugin(line.pid, line.device)];
    const mem = new uPlot({
      title: "Memory: allocated, reserved, outside the allocator, device free",
      width, height: 260, plugins,
      scales: { x: { time: false } },
      axes: [timeAxis, axisBytes],
      series: [{ label: "time" },
        { label: "allocated", stroke: "#3f6fd1", width: 1.5, value: (u, v) => bytes(v) },
        { label: "reserved", stroke: "#2ca02c", width: 1.5, value: (u, v) => bytes(v) },
        { label: "outside the allocator", stroke: "#7f7f7f", width: 1, value: (u, v) => bytes(v) },
        { label: "device free (last cudaMemGetInfo, less this process's allocations since)", stroke: "#17becf", width: 1, dash: [6, 4], value: (u, v) => bytes(v) }],
    }, [x, line.allocated, line.reserved, line.outside, line.device_free], box);
    mem.over.addEventListener("click", () => {
      const i = mem.cursor.idx;
      if (i !== null && i !== undefined) showSnapshotNear(line.t[i]);
    });
    const frag = new uPlot({
      title: "Fragmentation: largest free block against requests",
      width, height: 220, plugins,
      scales: { x: { time: false }, ratio: { range: [0, 1] } },
      axes: [timeAxis, axisBytes, { scale: "ratio", side: 1, grid: { show: false } }],
      series: [{ label: "time" },
        { label: "largest free block", stroke: "#2ca02c", width: 1.5, value: (u, v) => bytes(v) },
        { label: "largest request", stroke: "#d62728", width: 0, points: { show: true, size: 4 }, value: (u, v) => bytes(v) },
        { label: "fragmentation ratio", stroke: "#9467bd", width: 1, scale: "ratio", value: (u, v) => v === null ? "" : v.toFixed(3) }],
    }, [x, line.largest_free, line.request, line.fragmentation], box);
    const lat = new uPlot({
      title: "Device allocation latency (cudaMalloc and kin)",
      width, height: 200, plugins,
      // Latencies span microseconds (cached) to hundreds of milliseconds (synchronising).
      scales: { x: { time: false }, y: { distr: 3, log: 10 } },
      axes: [timeAxis, { values: (u, v) => v.map((n) => (n === null ? "" : dur(n))), size: 80 }],
      series: [{ label: "time" },
        { label: "p50", stroke: "#3f6fd1", width: 0, points: { show: true, size: 4 }, value: (u, v) => v === null ? "" : dur(v) },
        { label: "p99", stroke: "#d62728", width: 0, points: { show: true, size: 4 }, value: (u, v) => v === null ? "" : dur(v) }],
    }, [x, line.latency_p50_ns, line.latency_p99_ns], box);
    charts.push(mem, frag, lat);
  }
  if (D.lines.length === 0) chartSec.append(el("p", { text: "No device memory call in this window." }));
  if (D.markers_omitted > 0) chartSec.append(el("p", { class: "note", text: count(D.markers_omitted) + " more marks were left out." }));

  // Segment map.
  const mapSec = section("Segments and blocks", "segments");
  const pick = el("select", { id: "snapshot" });
  D.snapshots.forEach((sn, i) => {
    pick.append(el("option", { value: String(i), text: (sn.label === "oom" ? "at the OOM, " : sn.label === "end" ? "at the end, " : "") + rel(sn.at_ns) + " (" + utc(sn.at_ns) + ")" }));
  });
  mapSec.append(el("p", {}, "Moment: ", pick));
  mapSec.append(el("p", { class: "legend note" }, el("span", { class: "run allocated" }), "allocated block",
    el("span", { class: "run free" }), "free block (inside a segment)", el("span", { class: "run unmapped" }), "not mapped (expandable segment)"));
  const mapBox = el("div", { class: "segmap", id: "segmap" });
  mapSec.append(mapBox);
  function drawSnapshot(i) {
    const sn = D.snapshots[i];
    mapBox.textContent = "";
    if (!sn) return;
    if (sn.processes.length === 0) mapBox.append(el("p", { text: "No process held device memory at this moment." }));
    for (const p of sn.processes) {
      mapBox.append(el("h3", { text: (p.comm || "pid") + " (pid " + p.pid + "): " + p.view + " view" }));
      for (const d of p.devices) {
        mapBox.append(el("p", { class: "note", text: "device " + d.device + ": allocated " + bytes(d.total.allocated) + ", reserved " + bytes(d.total.reserved) +
          ", " + count(d.total.free_blocks) + " free blocks, largest " + bytes(d.total.largest_free) + ", outside the allocator " + bytes(d.outside) }));
        for (const pool of d.private_pools || []) {
          const whose = pool.captures ? "CUDA graphs', " + count(pool.captures.captures) + " capture(s), held by " + count(pool.captures.graphs) + " graph(s)" +
            (pool.captured_at ? ", first from " + pool.captured_at : "") : "a CUDA graph's or a MemPool's";
          mapBox.append(el("p", { class: "note", text: "private pool (" + pool.id[0] + ", " + pool.id[1] + ") (" + whose + "): reserved " + bytes(pool.reserved) +
            ", allocated " + bytes(pool.allocated) + ", " + bytes(pool.free) + " free in " + count(pool.free_blocks) + " blocks (largest " + bytes(pool.largest_free) +
            ") that only requests routed to this pool may use" }));
        }
      }
      if (p.view === "segments") {
        mapBox.append(el("p", { class: "note", text: "Only the device allocations are visible for this process (no PyTorch allocator probes were seen: another framework, an older PyTorch, or the cudaMallocAsync backend), so there are no blocks to map." }));
      } else {
        // The same moment as PyTorch's own memory snapshot, for its viewer and tools.
        const at = sn.label === "oom" ? "oom" : sn.label === "end" ? "end" : String(sn.at_ns);
        const cmd = "tracer export --format pytorch-snapshot --session " + D.session.id + " --pid " + p.pid +
          (at === "end" ? "" : " --at " + at) + " -o pid" + p.pid + "-" + (at === "end" || at === "oom" ? at : "t" + at) + ".pickle";
        mapBox.append(el("p", { class: "note export" }, "As PyTorch's memory snapshot (open it in ",
          el("a", { href: "https://pytorch.org/memory_viz", text: "pytorch.org/memory_viz" }), "): ", el("code", { text: cmd })));
      }
      const segs = p.segments.slice().sort((a, b) => a.device - b.device || b.size - a.size);
      for (const seg of segs) {
        const bar = el("div", { class: "bar" });
        for (const r of seg.runs) {
          const run = el("div", { class: "run " + r.kind });
          run.style.flexGrow = String(r.size);
          let text = r.kind + " " + bytes(r.size) + " (" + count(r.size) + " bytes) at 0x" + BigInt(r.addr).toString(16);
          if (r.kind === "allocated") {
            text += "\nrequested " + bytes(r.requested);
            if (r.since_ns) text += ", since " + rel(r.since_ns);
            if (r.stack !== undefined && D.sites[r.stack]) text += "\n" + D.sites[r.stack];
          }
          run.addEventListener("mousemove", (ev) => showTip(ev, text));
          run.addEventListener("mouseleave", hideTip);
          bar.append(run);
        }
        const pool = seg.pool_id ? " pool (" + seg.pool_id[0] + ", " + seg.pool_id[1] + ")" : "";
        const label = el("div", { class: "label", text: "dev " + seg.device + " " + (seg.pool || "?") + pool + " " + bytes(seg.size) + (seg.expandable ? " expandable" : "") + " 0x" + BigInt(seg.addr).toString(16) });
        mapBox.append(el("div", { class: "seg" }, label, bar));
      }
    }
    if (sn.segments_omitted > 0) mapBox.append(el("p", { class: "note", text: count(sn.segments_omitted) + " segments are left out of this moment's map to keep the page light (the largest are kept)." }));
  }
  function showSnapshotNear(ns) {
    let best = 0;
    D.snapshots.forEach((sn, i) => { if (Math.abs(sn.at_ns - ns) < Math.abs(D.snapshots[best].at_ns - ns)) best = i; });
    pick.value = String(best);
    drawSnapshot(best);
    mapSec.scrollIntoView();
  }
  pick.addEventListener("change", () => drawSnapshot(Number(pick.value)));
  const first = Math.max(0, D.snapshots.findIndex((sn) => sn.label === "oom"));
  const initial = D.snapshots.some((sn) => sn.label === "oom") ? first : D.snapshots.length - 1;
  pick.value = String(initial);
  drawSnapshot(initial);

  // Causal chains.
  const chainSec = section("What happened: causal chains", "chains");
  if (E.chains.length === 0) chainSec.append(el("p", { text: "No chain: nothing in this window matched a rule." }));
  for (const c of E.chains) {
    const box = el("div", { class: "chain " + c.severity.toLowerCase() });
    box.append(el("h3", { text: "[" + c.severity + "] " + c.title + " (pid " + c.pid + ", " + c.rule + ")" }));
    box.append(el("p", { text: "Root cause: " + c.root }));
    box.append(el("p", { text: "Effect: " + c.effect }));
    if (c.compounding.length) box.append(el("ul", {}, ...c.compounding.map((x) => el("li", { text: x }))));
    if (c.timeline.length) box.append(el("ul", {}, ...c.timeline.map((x) => el("li", { text: rel(x.ts_ns) + ": " + x.text }))));
    if (c.fix.length) box.append(el("p", { text: "Fix:" }), el("ul", {}, ...c.fix.map((x) => el("li", { text: x }))));
    box.append(el("p", { class: "note", text: "Evidence: " + c.evidence }));
    chainSec.append(box);
  }

  // Who held the GPU at each out-of-memory (analysis/rules/tenants.rs).
  const VERDICTS = {
    other_processes: "held by other processes on the GPU",
    this_process: "in use by this process's tensors (its cache did not hold it)",
    beyond_device: "more than the device could give this process even with none of its memory held",
    fragmentation: "in this process's cache, in no block that fit (fragmentation)",
    unknown: "not known: the OOM chain says what would settle it",
  };
  if ((E.holders || []).length) {
    const hSec = section("Who held the GPU at the out-of-memory", "holders");
    for (const h of E.holders) {
      hSec.append(el("h3", { text: "pid " + h.pid + " on " + h.gpu + " (device " + h.device + ") at " + utc(h.at_ns) + ": " + bytes(h.requested) + " asked" }));
      const rows = [];
      if (h.allocated !== null) rows.push(["this process: allocated by PyTorch", bytes(h.allocated)]);
      if (h.cached !== null) rows.push(["this process: reserved by PyTorch but unallocated", bytes(h.cached)]);
      for (const o of h.outside) rows.push(["this process, outside the allocator: " + o.library + " (" + o.allocations + " allocations)", bytes(o.bytes)]);
      rows.push(["this process, all its traced calls held", bytes(h.held)]);
      if (h.untraced !== null) rows.push(["this process, beyond its traced calls (PyTorch's message or NVML: its CUDA context)", bytes(h.untraced)]);
      for (const t of h.others) rows.push(["pid " + t.pid + (t.comm ? " (" + t.comm + ")" : "") + (t.from_message ? ", named by PyTorch's message" : t.nvml_at_ns ? ", named by NVML at " + utc(t.nvml_at_ns) : t.since_ns ? ", since " + utc(t.since_ns) : ""), bytes(t.bytes)]);
      if (h.unattributed !== null) rows.push(["held by no traced process and none PyTorch's message or NVML names", bytes(h.unattributed)]);
      if (h.device_free !== null) rows.push(["free on the device", bytes(h.device_free)]);
      if (h.device_total !== null) rows.push(["the device in all", bytes(h.device_total)]);
      hSec.append(table(["who", "bytes"], rows, [false, true]));
      hSec.append(el("p", { text: "The memory the request needed was " + (VERDICTS[h.verdict] || h.verdict) + "." }));
    }
  }

  // When PyTorch's allocator probes were armed (--allocator auto).
  if ((E.arming || []).length) {
    const aSec = section("When PyTorch's allocator probes were armed (--allocator auto)", "arming");
    aSec.append(el("p", { text: "The block layout is known only while a process is armed, and then only in segments made after arming: segments made before hold blocks tracer did not see, kept out of every figure, never shown free." }));
    const SAYS = {
      not_armed_yet: "not armed when first seen", reserved: "its device memory passed its share of the GPU",
      cache_miss: "a device allocation after warm-up", failed_allocation: "a failed device allocation",
      out_of_memory: "PyTorch's out-of-memory error", on_demand: "root asked (SIGUSR1)", quiet: "a quiet period",
      on_demand_ended: "root's asking ended (SIGUSR2)", failed: "arming failed", ended: "the process ended",
    };
    aSec.append(table(["pid", "when", "armed", "why", "held / GPU"],
      E.arming.map((a) => [String(a.pid), utc(a.ts_ns), a.armed ? "armed" : "disarmed",
        SAYS[a.reason] || String(a.reason), a.total ? bytes(a.held) + " / " + bytes(a.total) : ""]),
      [false, false, false, false, true]));
  }

  // The requests under other allocator settings (tracer whatif).
  if (D.whatif) {
    const W = D.whatif, F = W.fidelity;
    const wSec = section("What would have avoided it", "whatif");
    wSec.append(el("p", { text: F.holds
      ? "Replayed through PyTorch's allocator policy, pid " + W.pid + " on device " + W.device + ": with the settings it ran with the simulator makes the same " + F.device_allocs_recorded + " device allocations and places " + F.placements_matched + " of " + F.placements + " blocks where the allocator did, so the other rows are a prediction."
      : "The simulator does not reproduce this run (" + F.placements_matched + " of " + F.placements + " blocks where the allocator put them): the rows below are the simulator's, not a prediction." }));
    const t = table(["settings", "OOM", "peak reserved", "peak cached", "device allocations", "retries", "least memory"],
      W.rows.map((r) => [(r.recorded_settings ? "(as run) " : "") + (r.conf || "defaults"), r.oom_request === null ? "none" : "request " + r.oom_request,
        bytes(r.peak_reserved), bytes(r.peak_cached), count(r.device_allocs), count(r.retries), r.least_memory === undefined ? "-" : bytes(r.least_memory)]),
      [false, false, true, true, true, true, true]);
    t.classList.add("whatif");
    wSec.append(t);
  }

  // Per-process tables.
  const procSec = section("Calls per process", "processes");
  for (const p of E.processes) {
    procSec.append(el("h3", { text: (p.comm || "pid") + " (pid " + p.pid + ")" }));
    const t = table(["op", "calls", "errors", "p50", "p99", "max", "bytes"],
      p.ops.map((o) => [o.op, count(o.calls), count(o.errors), dur(o.p50_ns), dur(o.p99_ns), dur(o.max_ns), count(o.bytes)]),
      [false, true, true, true, true, true, true]);
    t.classList.add("ops");
    t.dataset.pid = String(p.pid);
    procSec.append(t);
    for (const w of p.warnings) procSec.append(el("p", { class: "note", text: "Warning: " + w }));
  }
  if (E.devices.length) {
    procSec.append(el("h3", { text: "Per device" }));
    procSec.append(table(["pid", "device", "GPU", "job", "view", "peak held", "peak reserved", "peak allocated", "fragmentation", "failures"],
      E.devices.map((d) => [String(d.pid), String(d.device), d.gpu, d.job, d.view, bytes(d.peak_held), bytes(d.peak_reserved), bytes(d.peak_allocated), d.fragmentation.toFixed(3), count(d.failures)]),
      [true, true, false, false, false, true, true, true, true, true]));
  }

  // Call sites.
  const siteSec = section("Top call sites", "sites");
  if (E.call_sites.length === 0) siteSec.append(el("p", { text: "No call sites: record with `tracer trace --stack` to see them." }));
  else siteSec.append(table(["op", "pid", "call site", "calls", "bytes", "avg", "p99"],
    E.call_sites.map((c) => [c.op, String(c.pid), c.site, count(c.calls), count(c.bytes), dur(c.avg_ns), dur(c.p99_ns)]),
    [false, true, false, true, true, true, true]));

  // Losses.
  const lossSec = section("What tracer could not keep", "losses");
  lossSec.append(el("p", { text: lost === 0 ? "Nothing was lost: every event read was stored." :
    count(lost) + " events or records could not be kept; the figures below miss them." }));
  lossSec.append(table(["counter", "value"], D.losses.map(([k, v]) => [k, count(v)]), [false, true]));

  window.__tracerReportReady = charts.length;
})();
