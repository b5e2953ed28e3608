//! The property the `torch` fuzz target checks on arbitrary bytes, shared by path (`#[path]`)
//! with the reader's unit tests (`rust/torch/tests/corpus.rs`), which run it over mutated
//! fixtures without a fuzzer. The includer provides `torch` (`stcast::torch` or
//! `crate::torch`) in the parent module.
//!
//! - `sniff`, `read`, `tensor_dicts`, `select` and `gather` never panic, whatever the bytes;
//! - every storage `read` accepts lies inside the file;
//! - every selected tensor passes its own checks, lies inside the file, and gathers: a window
//!   from its start, its last element, element by element (for small tensors) the same bytes,
//!   and, when it is contiguous and little-endian, the file's own bytes.

use super::torch;

/// Elements gathered at most per tensor.
const WINDOW: u64 = 1024;

/// Check `data`; returns how many tensors were selected and gathered.
pub fn check(data: &[u8]) -> usize {
    let _ = torch::sniff(data);
    let limits = torch::Limits {
        max_pickle_bytes: 1 << 22,
        max_objects: 1 << 18,
        ..torch::Limits::default()
    };
    let Ok(ck) = torch::read(data, &limits) else {
        return 0;
    };
    for s in &ck.storages {
        let end = s.offset.checked_add(s.len).expect("storage end overflows");
        assert!(
            end <= data.len() as u64,
            "storage `{}` outside the file",
            s.key
        );
    }
    let _ = ck.tensor_dicts();
    let mut gathered = 0;
    for key in [None, Some("")] {
        let Ok(sel) = ck.select(key) else {
            continue;
        };
        for t in &sel.tensors {
            let d = &t.desc;
            d.validate().expect("a selected tensor is valid");
            let span = d.span();
            assert!(span.start <= span.end && span.end <= data.len() as u64);
            let es = d.elem_size() as usize;
            let count = d.numel().min(WINDOW);
            let mut out = vec![0u8; count as usize * es];
            torch::gather(data, d, 0, &mut out).expect("a selected tensor gathers");
            if d.numel() > 0 {
                let mut last = vec![0u8; es];
                torch::gather(data, d, d.numel() - 1, &mut last).expect("its last element gathers");
            }
            if count <= 64 {
                let mut one = vec![0u8; es];
                for i in 0..count as usize {
                    torch::gather(data, d, i as u64, &mut one).unwrap();
                    assert_eq!(
                        one,
                        out[i * es..(i + 1) * es],
                        "element {i} of `{}`",
                        t.name
                    );
                }
            }
            if let (Some(r), false) = (d.contiguous_range(), d.big_endian) {
                let r = r.start as usize..r.start as usize + out.len();
                assert_eq!(data[r], out[..], "contiguous `{}`", t.name);
            }
            gathered += 1;
        }
    }
    gathered
}
