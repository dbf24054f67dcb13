//! Events handed between threads as the ring's bytes, decoded by the thread that uses them: a
//! decoded call is larger than its event, and writing it out on one thread to read it back on
//! another cost more than the decoding.

use super::{decode, DecodeError, Record};

/// Events' bytes, and where each lies in them, in the order they are to be decoded (not
/// necessarily the bytes' order).
#[derive(Debug, Default)]
pub struct EventBytes {
    bytes: Vec<u8>,
    /// (offset, length) in `bytes`.
    spans: Vec<(u32, u32)>,
}

impl EventBytes {
    /// Bytes already laid out, and the spans of those to decode, in order (each within
    /// `bytes`, as [`EventBytes::decode`] checks).
    pub fn new(bytes: Vec<u8>, spans: Vec<(u32, u32)>) -> EventBytes {
        EventBytes { bytes, spans }
    }

    /// Appends one event (of [`super::events`]).
    pub fn push(&mut self, event: &[u8]) {
        self.spans
            .push((self.bytes.len() as u32, event.len() as u32));
        self.bytes.extend_from_slice(event);
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Each event decoded, in order (a span outside the bytes reads as truncated).
    pub fn decode(&self) -> impl Iterator<Item = Result<Record, DecodeError>> + '_ {
        self.spans.iter().map(|&(at, len)| {
            let (at, len) = (at as usize, len as usize);
            match self.bytes.get(at..at.saturating_add(len)) {
                Some(event) => decode(event),
                None => Err(DecodeError::Truncated { len }),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracer_common::{sched::ExitEvent, EventHeader};

    fn exit(pid: u32) -> ExitEvent {
        ExitEvent {
            header: EventHeader {
                kind: ExitEvent::KIND as u32,
                len: ExitEvent::LEN,
                ts_ns: u64::from(pid) * 10,
                pid,
                tid: pid,
            },
        }
    }

    fn pids(events: &EventBytes) -> Vec<Result<u32, DecodeError>> {
        events
            .decode()
            .map(|r| {
                r.map(|record| match record {
                    Record::Exit { pid, .. } => pid,
                    other => panic!("unexpected {other:?}"),
                })
            })
            .collect()
    }

    /// Pushed events decode in the order pushed; spans given decode in their order, whatever
    /// the bytes' order, and one outside the bytes fails alone.
    #[test]
    fn events_decode_in_their_spans_order() {
        let mut pushed = EventBytes::default();
        for pid in [3, 1, 2] {
            pushed.push(super::super::pod_bytes(&exit(pid)));
        }
        assert_eq!(pushed.len(), 3);
        assert_eq!(pids(&pushed), [Ok(3), Ok(1), Ok(2)]);
        let len = ExitEvent::LEN;
        let bytes = pushed.bytes.clone();
        let spans = vec![(2 * len, len), (0, len), (3 * len, len), (len, len)];
        let given = EventBytes::new(bytes, spans);
        assert_eq!(
            pids(&given),
            [
                Ok(2),
                Ok(3),
                Err(DecodeError::Truncated { len: len as usize }),
                Ok(1)
            ]
        );
        assert!(EventBytes::default().is_empty());
    }
}
