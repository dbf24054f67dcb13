use tracer_common::{call::flags, CallEvent, EventHeader, Op};

use super::*;

fn raw_call() -> CallEvent {
    let mut comm = [0u8; 16];
    comm[..6].copy_from_slice(b"python");
    CallEvent {
        header: EventHeader {
            kind: 1,
            len: CallEvent::LEN,
            ts_ns: 42,
            pid: 7,
            tid: 8,
        },
        op: Op::CudaMalloc as u32,
        device: 1,
        ret: 0,
        flags: flags::SIZE_KNOWN | flags::PTR_KNOWN,
        duration_ns: 1500,
        size: 1 << 20,
        ptr: 0x7f00_0000_0000,
        aux0: 0,
        aux1: 0,
        stack_id: -1,
        comm,
    }
}

fn bytes_of(ev: &CallEvent) -> Vec<u8> {
    pod_bytes(ev).to_vec()
}

#[test]
fn layout_has_no_implicit_padding() {
    // Header 24 + 4 x u32 + 5 x u64 + i64 + 16 bytes of comm.
    assert_eq!(std::mem::size_of::<EventHeader>(), 24);
    assert_eq!(std::mem::size_of::<CallEvent>(), 24 + 16 + 40 + 8 + 16);
}

#[test]
fn decodes_a_call() {
    let Record::Call(call) = decode(&bytes_of(&raw_call())).unwrap() else {
        panic!("not a call")
    };
    assert_eq!(call.op, Op::CudaMalloc);
    assert_eq!((call.pid, call.tid, call.ts_mono_ns), (7, 8, 42));
    assert_eq!(call.device, Some(1));
    assert_eq!(call.size, Some(1 << 20));
    assert_eq!(call.ptr, Some(0x7f00_0000_0000));
    assert_eq!(call.comm, "python");
}

#[test]
fn unknown_fields_become_none() {
    let mut raw = raw_call();
    raw.device = -1;
    raw.flags = 0;
    let Record::Call(call) = decode(&bytes_of(&raw)).unwrap() else {
        panic!("not a call")
    };
    assert_eq!((call.device, call.size, call.ptr), (None, None, None));
}

#[test]
fn accepts_ring_padding_after_the_record() {
    let mut bytes = bytes_of(&raw_call());
    bytes.extend_from_slice(&[0; 8]);
    assert!(decode(&bytes).is_ok());
}

#[test]
fn a_stage_of_events_back_to_back_decodes_each_and_stops_at_a_bad_one() {
    let mut second = raw_call();
    second.header.ts_ns = 43;
    second.op = Op::CudaFree as u32;
    let mut bytes = bytes_of(&raw_call());
    bytes.extend_from_slice(&bytes_of(&second));
    let ops: Vec<Op> = decode_all(&bytes)
        .map(|r| match r.unwrap() {
            Record::Call(call) => call.op,
            other => panic!("not a call: {other:?}"),
        })
        .collect();
    assert_eq!(ops, [Op::CudaMalloc, Op::CudaFree]);
    // The ring's rounding after the last one is not an event.
    let mut padded = bytes.clone();
    padded.extend_from_slice(&[0; 8]);
    assert_eq!(decode_all(&padded).count(), 2);
    // A second event whose header lies about its length: the first stands, the second is an
    // error, and nothing after it is read.
    let mut bad = bytes_of(&raw_call());
    let mut lying = bytes_of(&second);
    lying[4] = 8;
    bad.extend_from_slice(&lying);
    bad.extend_from_slice(&bytes_of(&raw_call()));
    let results: Vec<_> = decode_all(&bad).collect();
    assert_eq!(results.len(), 2);
    assert!(results[0].is_ok());
    assert!(matches!(results[1], Err(DecodeError::BadLength { .. })));
    // A cut-off tail is an error too.
    let cut = &bytes[..bytes.len() - 10];
    let results: Vec<_> = decode_all(cut).collect();
    assert_eq!(results.len(), 2);
    assert!(results[1].is_err());
}

#[test]
fn rejects_truncated_records() {
    let bytes = bytes_of(&raw_call());
    assert_eq!(
        decode(&bytes[..10]),
        Err(DecodeError::Truncated { len: 10 })
    );
    assert!(matches!(
        decode(&bytes[..60]),
        Err(DecodeError::BadLength { actual: 60, .. })
    ));
}

#[test]
fn rejects_unknown_kind_and_length_mismatch() {
    let mut raw = raw_call();
    raw.header.kind = 99;
    assert_eq!(decode(&bytes_of(&raw)), Err(DecodeError::UnknownKind(99)));
    let mut raw = raw_call();
    raw.header.len = 12;
    assert!(matches!(
        decode(&bytes_of(&raw)),
        Err(DecodeError::BadLength { header_len: 12, .. })
    ));
}

#[test]
fn rejects_unknown_op() {
    let mut raw = raw_call();
    raw.op = 1000;
    assert_eq!(
        decode(&bytes_of(&raw)),
        Err(DecodeError::BadField {
            field: "op",
            value: 1000
        })
    );
}

#[test]
fn probe_table_names_are_unique_and_variants_do_not_collide() {
    let mut names: Vec<&str> = Op::ALL.iter().map(|op| op.name()).collect();
    names.sort_unstable();
    let before = names.len();
    names.dedup();
    assert_eq!(names.len(), before);
    for op in Op::ALL {
        for suffix in tracer_common::probes::VARIANT_SUFFIXES {
            let variant = format!("{}{suffix}", op.name());
            assert!(
                Op::ALL.iter().all(|o| o.name() != variant),
                "{variant} is also a base name"
            );
        }
    }
}

#[test]
fn decodes_an_off_cpu_interval() {
    let raw = tracer_common::SchedEvent {
        header: EventHeader {
            kind: 2,
            len: tracer_common::SchedEvent::LEN,
            ts_ns: 100,
            pid: 7,
            tid: 8,
        },
        on_ns: 250,
        wakeup_ns: 0,
        preempted: 1,
        _pad: 0,
    };
    let bytes = pod_bytes(&raw);
    let Record::OffCpu(off) = decode(bytes).unwrap() else {
        panic!("not a sched record")
    };
    assert_eq!(
        (off.pid, off.tid, off.off_mono_ns, off.on_mono_ns),
        (7, 8, 100, 250)
    );
    assert!(off.preempted && off.wakeup_mono_ns.is_none());
    let mut bad = raw;
    bad.on_ns = 50;
    let bytes = pod_bytes(&bad);
    assert!(matches!(
        decode(bytes),
        Err(DecodeError::BadField { field: "on_ns", .. })
    ));
}

fn stack_event() -> tracer_common::CallStackEvent {
    use tracer_common::{stack::py_status, PyFrame, PyStack};
    let mut ev = tracer_common::CallStackEvent {
        call: raw_call(),
        native_depth: 2,
        _pad: 0,
        native: [0; tracer_common::stack::MAX_NATIVE_FRAMES],
        py: PyStack {
            status: py_status::OK,
            depth: 1,
            tstate: 0x5000,
            frames: [PyFrame::default(); tracer_common::stack::MAX_PY_FRAMES],
        },
    };
    ev.call.header.kind = EventKind::CallStack as u32;
    ev.call.header.len = tracer_common::CallStackEvent::LEN;
    ev.native[..3].copy_from_slice(&[0x401000, 0x401100, 0xdead]);
    ev.py.frames[0] = PyFrame {
        code: 0x7000,
        instr: 0x7100,
        flags: tracer_common::stack::py_frame_flags::ENTRY,
        _pad: 0,
    };
    ev
}

fn stack_bytes(ev: &tracer_common::CallStackEvent) -> Vec<u8> {
    pod_bytes(ev).to_vec()
}

#[test]
fn stack_layout_has_no_implicit_padding() {
    // The call, depth + pad, 32 return addresses, then status, depth, tstate and 32 frames of
    // code, instr, flags + pad.
    assert_eq!(
        std::mem::size_of::<tracer_common::CallStackEvent>(),
        std::mem::size_of::<CallEvent>() + 8 + 32 * 8 + 16 + 32 * 24
    );
}

#[test]
fn decodes_a_call_with_its_site_up_to_the_depths_sent() {
    let Record::Call(call) = decode(&stack_bytes(&stack_event())).unwrap() else {
        panic!("not a call");
    };
    assert_eq!((call.op, call.size), (Op::CudaMalloc, Some(1 << 20)));
    let site = call.site.expect("a call site");
    assert_eq!(
        site.native,
        NativeStackRef::Inline(vec![0x401000, 0x401100])
    );
    assert_eq!(site.py_status, PyStatus::Ok);
    assert_eq!(
        site.py,
        [RawPyFrame {
            code: 0x7000,
            instr: 0x7100,
            entry: true
        }]
    );
}

/// A call with two Python frames as the call-site program sends it: only the frames read.
fn call_py_bytes(depth: u32, stack_id: i64) -> Vec<u8> {
    use tracer_common::stack::{py_status, CallPyEvent};
    let full = stack_event();
    let mut ev = CallPyEvent {
        call: full.call,
        py: full.py,
    };
    ev.call.header.kind = EventKind::CallPy as u32;
    ev.call.header.len = CallPyEvent::len_for(depth);
    ev.call.stack_id = stack_id;
    ev.py.status = py_status::OK;
    ev.py.depth = depth;
    ev.py.frames[1] = tracer_common::PyFrame {
        code: 0x7200,
        instr: 0x7300,
        flags: 0,
        _pad: 0,
    };
    pod_bytes(&ev)[..CallPyEvent::len_for(depth) as usize].to_vec()
}

#[test]
fn decodes_a_call_with_its_python_frames_and_its_native_stack_by_id() {
    let bytes = call_py_bytes(2, 77);
    // 104 bytes of call, 16 of status, depth and thread state, 24 a frame.
    assert_eq!(bytes.len(), 104 + 16 + 2 * 24);
    let Record::Call(call) = decode(&bytes).unwrap() else {
        panic!("not a call");
    };
    let site = call.site.expect("a call site");
    assert_eq!(site.native, NativeStackRef::Kept(77));
    assert_eq!(site.py_status, PyStatus::Ok);
    assert_eq!(site.py.len(), 2);
    assert_eq!((site.py[1].code, site.py[1].instr), (0x7200, 0x7300));
    // Framed by its own length, and followed by the next event of the same bytes.
    let mut two = bytes.clone();
    two.extend_from_slice(&bytes_of(&raw_call()));
    let framed: Vec<usize> = events(&two).map(|e| e.unwrap().0.len()).collect();
    assert_eq!(framed, [bytes.len(), CallEvent::LEN as usize]);
    assert!(is_call_py(&bytes) && !is_call_py(&bytes_of(&raw_call())));
}

#[test]
fn a_python_record_whose_length_disagrees_with_its_depth_or_without_a_stack_is_refused() {
    // Two frames said, three sent.
    let mut bytes = call_py_bytes(3, 5);
    bytes[120 - 16 + 4..120 - 16 + 8].copy_from_slice(&2u32.to_le_bytes());
    assert!(matches!(
        decode(&bytes),
        Err(DecodeError::BadField {
            field: "py.depth",
            value: 2
        })
    ));
    // A length between two frame counts.
    let mut bytes = call_py_bytes(1, 5);
    let said = bytes.len() as u32 + 8;
    bytes[4..8].copy_from_slice(&said.to_le_bytes());
    bytes.extend_from_slice(&[0; 8]);
    assert!(matches!(decode(&bytes), Err(DecodeError::BadLength { .. })));
    // Shorter than the bytes its header says.
    let bytes = call_py_bytes(2, 5);
    assert!(matches!(
        decode(&bytes[..bytes.len() - 24]),
        Err(DecodeError::BadLength { .. })
    ));
    assert!(matches!(
        decode(&call_py_bytes(1, -1)),
        Err(DecodeError::BadField {
            field: "stack_id",
            ..
        })
    ));
}

#[test]
fn a_plain_call_with_a_kept_stack_id_has_a_native_site_and_one_without_has_none() {
    let mut raw = raw_call();
    raw.stack_id = 12;
    let Record::Call(call) = decode(&bytes_of(&raw)).unwrap() else {
        panic!("not a call");
    };
    let site = call.site.expect("a call site");
    assert_eq!(
        (site.native, site.py_status, site.py.len()),
        (NativeStackRef::Kept(12), PyStatus::NotPython, 0)
    );
    let Record::Call(call) = decode(&bytes_of(&raw_call())).unwrap() else {
        panic!("not a call");
    };
    assert!(call.site.is_none());
}

#[test]
fn a_site_deeper_than_its_arrays_or_of_unknown_status_is_refused() {
    let mut ev = stack_event();
    ev.native_depth = 33;
    assert!(matches!(
        decode(&stack_bytes(&ev)),
        Err(DecodeError::BadField {
            field: "native_depth",
            value: 33
        })
    ));
    let mut ev = stack_event();
    ev.py.depth = 40;
    assert!(matches!(
        decode(&stack_bytes(&ev)),
        Err(DecodeError::BadField {
            field: "py.depth",
            ..
        })
    ));
    let mut ev = stack_event();
    ev.py.status = 9;
    assert!(matches!(
        decode(&stack_bytes(&ev)),
        Err(DecodeError::BadField {
            field: "py.status",
            value: 9
        })
    ));
    // A plain call's length under the stack kind is a length error, not a misread.
    let mut short = raw_call();
    short.header.kind = EventKind::CallStack as u32;
    assert!(matches!(
        decode(&bytes_of(&short)),
        Err(DecodeError::BadLength { .. })
    ));
}

#[test]
fn an_exit_record_names_the_pid_and_a_wrong_length_is_refused() {
    let raw = tracer_common::sched::ExitEvent {
        header: EventHeader {
            kind: 5,
            len: tracer_common::sched::ExitEvent::LEN,
            ts_ns: 9,
            pid: 4321,
            tid: 4321,
        },
    };
    let bytes = pod_bytes(&raw);
    assert_eq!(
        decode(bytes).unwrap(),
        Record::Exit {
            pid: 4321,
            ts_mono_ns: 9
        }
    );
    let mut long = bytes.to_vec();
    long[4] = 32;
    assert!(matches!(decode(&long), Err(DecodeError::BadLength { .. })));
}
