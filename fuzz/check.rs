//! The property both the fuzz target and `tests/props.rs` check, on arbitrary bytes.
//!
//! Shared by path (`#[path]`), so the fuzzer and CI test exactly the same thing:
//! - `read_header` and `plan` never panic, whatever the bytes;
//! - `read_header` accepts exactly what the `safetensors` crate's `read_metadata` accepts,
//!   less headers with a repeated name (which the crate's map hides), and reads the same
//!   tensors and metadata;
//! - a header they accept is consistent: tensors sorted, contiguous from 0, covering the file;
//! - its plan, for both targets, is contiguous and aligned, and for small files an
//!   in-memory conversion (the same plan and slice kernels as a real run, without files)
//!   gives bytes that `read_header` accepts again, with the same names, shapes, metadata
//!   and the planned dtypes and offsets; the SIMD kernels give the scalar ones' bytes.

use std::path::Path;

use stcast::header::{self, SourceHeader, PREFIX};
use stcast::kernels::Isa;
use stcast::plan::{self, Plan, PlanOptions};
use stcast::{Action, Target};

/// Files up to this size are also converted in memory.
pub const CONVERT_MAX: usize = 1 << 16;

/// Check `data`; returns whether `read_header` accepted it.
pub fn check(data: &[u8]) -> bool {
    let path = Path::new("fuzz.safetensors");
    let ours = header::read_header(path, data);
    same_as_the_crate(&ours, data);
    let Ok(src) = ours else {
        return false;
    };
    check_source(&src, data.len() as u64);
    for target in [Target::Bf16, Target::F16] {
        // Only an output header over the 100 MB limit is refused here: not at these sizes.
        // BF16 sources are converted under F16 too, so the fuzzer reaches that kernel.
        // Any dtype mix plans, F8/F4 beside F32 (a quantized checkpoint) too.
        let opts = PlanOptions {
            from_bf16: true,
            allow_quantized: true,
            ..PlanOptions::new(target)
        };
        let plan = plan::plan(path, &src, &opts).expect("a valid header plans");
        check_plan(&src, &plan);
        if data.len() <= CONVERT_MAX {
            let out = convert_in_memory(data, &src, &plan, Isa::Scalar);
            let fast = convert_in_memory(data, &src, &plan, Isa::detect());
            assert!(out == fast, "SIMD and scalar kernels disagree");
            check_round_trip(&src, &plan, &out);
        }
    }
    true
}

/// Our single-pass header reader against the crate's own validation.
fn same_as_the_crate(ours: &stcast::error::Result<SourceHeader>, data: &[u8]) {
    if let Err(e) = ours {
        // Offsets ending past u64: the crate's unchecked addition would panic on these.
        if e.to_string().contains(header::END_OVERFLOWS) {
            return;
        }
    }
    match (ours, safetensors::SafeTensors::read_metadata(data)) {
        (Ok(src), Ok((n, meta))) => {
            assert_eq!(src.header_len, n as u64);
            assert_eq!(src.tensors.len(), meta.offset_keys().len(), "tensor count");
            for t in &src.tensors {
                let info = meta.info(&t.name).expect("a tensor the crate has");
                assert_eq!(info.dtype, t.dtype, "tensor `{}`", t.name);
                assert_eq!(info.shape, t.shape, "tensor `{}`", t.name);
                assert_eq!(info.data_offsets, (t.start as usize, t.end as usize));
            }
            let theirs = meta.metadata().clone().unwrap_or_default();
            let ours = src.metadata.clone().unwrap_or_default();
            assert_eq!(ours.len(), theirs.len(), "metadata keys");
            for (k, v) in &ours {
                assert_eq!(theirs.get(k), Some(v), "metadata `{k}`");
            }
        }
        (Ok(_), Err(e)) => panic!("accepted a header the crate refuses: {e}"),
        (Err(e), Ok(_)) => {
            let e = e.to_string();
            assert!(
                e.contains(": duplicate "),
                "refused a header the crate accepts: {e}"
            );
        }
        (Err(_), Err(_)) => {}
    }
}

fn check_source(src: &SourceHeader, file_len: u64) {
    let mut at = 0;
    for t in &src.tensors {
        assert_eq!(
            t.start, at,
            "tensor `{}` does not follow the previous one",
            t.name
        );
        assert!(t.end >= t.start);
        let elems = t
            .shape
            .iter()
            .fold(1u128, |n, &d| n.saturating_mul(d as u128));
        let bits = elems.saturating_mul(t.dtype.bitsize() as u128);
        assert_eq!(bits, (t.len() as u128) * 8, "tensor `{}` size", t.name);
        at = t.end;
    }
    assert_eq!(src.data_start() + src.data_len(), file_len);
}

fn elem_bytes(bits: usize) -> u64 {
    if bits.is_multiple_of(8) {
        (bits / 8) as u64
    } else {
        1
    }
}

fn check_plan(src: &SourceHeader, plan: &Plan) {
    assert_eq!(plan.tensors.len(), src.tensors.len());
    assert!(plan.header.len() >= PREFIX && plan.header.len().is_multiple_of(8));
    let mut seen = vec![false; src.tensors.len()];
    let mut at = 0;
    for t in &plan.tensors {
        assert!(
            !std::mem::replace(&mut seen[t.source], true),
            "tensor planned twice"
        );
        let s = &src.tensors[t.source];
        assert_eq!(t.start, at);
        assert_eq!(
            t.start % elem_bytes(t.dtype.bitsize()),
            0,
            "misaligned `{}`",
            s.name
        );
        let expected = match t.action {
            Action::Copy => {
                assert_eq!(t.dtype, s.dtype);
                s.len()
            }
            Action::Convert(c) => {
                assert_eq!(Some(t.dtype), plan.target.dtype());
                s.len() / c.src_size() * 2
            }
            // The fuzzed plans are bf16/fp16 ones.
            Action::Quantize(_) | Action::Dequantize(_) => unreachable!("no FP8 here"),
        };
        assert_eq!(t.end - t.start, expected);
        at = t.end;
    }
}

/// The whole output file, built in memory the way `Job` builds it on disk.
pub fn convert_in_memory(data: &[u8], src: &SourceHeader, plan: &Plan, isa: Isa) -> Vec<u8> {
    let mut out = plan.header.clone();
    out.resize(plan.file_len() as usize, 0);
    let (src_base, dst_base) = (src.data_start() as usize, plan.data_start() as usize);
    for t in &plan.tensors {
        let s = &src.tensors[t.source];
        let from = &data[src_base + s.start as usize..src_base + s.end as usize];
        let to = &mut out[dst_base + t.start as usize..dst_base + t.end as usize];
        t.action.apply(isa, from, to);
    }
    out
}

fn check_round_trip(src: &SourceHeader, plan: &Plan, out: &[u8]) {
    let back = header::read_header(Path::new("out.safetensors"), out)
        .unwrap_or_else(|e| panic!("our own output does not parse: {e}"));
    assert_eq!(back.metadata, src.metadata);
    assert_eq!(back.data_start(), plan.data_start());
    assert_eq!(back.tensors.len(), plan.tensors.len());
    // Output tensors sorted by offset are the plan's order (empty ones tie in key order,
    // which is the plan's order too).
    for (b, t) in back.tensors.iter().zip(&plan.tensors) {
        let s = &src.tensors[t.source];
        assert_eq!(b.name, s.name);
        assert_eq!(b.shape, s.shape);
        assert_eq!(b.dtype, t.dtype);
        assert_eq!((b.start, b.end), (t.start, t.end));
    }
}
