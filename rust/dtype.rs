//! Conversions between dtypes: which exist, their element sizes, overflow points, and the
//! kernel that performs each.

use safetensors::tensor::Dtype;

use crate::kernels::{self, Isa};
use crate::vocab::Target;

/// Which kernel turns a source tensor into its output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conversion {
    F32ToBf16,
    F16ToBf16,
    F64ToBf16,
    F32ToF16,
    F64ToF16,
    Bf16ToF16,
}

/// A kernel: source bytes in, output bytes out, any alignment
/// (`dst.len() == src.len() / conv.src_size() * conv.dst_size()`).
pub type Kernel = fn(Isa, &[u8], &mut [u8]);

/// The smallest magnitude that rounds to infinity in bf16: the f32 midpoint 0x7F7F8000
/// between the largest bf16 (0x7F7F, odd) and 2^128, which ties upwards: 2^128 - 2^119.
pub const BF16_OVERFLOW: f64 = 339_617_752_923_046_005_526_922_703_901_628_039_168.0;
/// The smallest magnitude that rounds to infinity in f16: 65520, the midpoint between
/// 65504 (0x7BFF, odd) and 2^16, which ties upwards.
pub const F16_OVERFLOW: f64 = 65520.0;

/// Every conversion, with its source and output dtypes and its kernel: the one table
/// `between`, the sizes, `kernel` (and through it `fused`'s reference path) read. A new
/// target (an FP8 one) adds its rows here and its arms to `overflows`, `numerics::measure`
/// and `fused::step` (`None` there: no fast path, the kernel then `measure`).
const TABLE: [(Conversion, Dtype, Dtype, Kernel); 6] = [
    (
        Conversion::F32ToBf16,
        Dtype::F32,
        Dtype::BF16,
        kernels::f32_to_bf16,
    ),
    (
        Conversion::F16ToBf16,
        Dtype::F16,
        Dtype::BF16,
        kernels::f16_to_bf16,
    ),
    (
        Conversion::F64ToBf16,
        Dtype::F64,
        Dtype::BF16,
        kernels::f64_to_bf16,
    ),
    (
        Conversion::F32ToF16,
        Dtype::F32,
        Dtype::F16,
        kernels::f32_to_f16,
    ),
    (
        Conversion::F64ToF16,
        Dtype::F64,
        Dtype::F16,
        kernels::f64_to_f16,
    ),
    (
        Conversion::Bf16ToF16,
        Dtype::BF16,
        Dtype::F16,
        kernels::bf16_to_f16,
    ),
];

impl Conversion {
    /// Every conversion, in the table's order.
    pub const ALL: [Conversion; TABLE.len()] = {
        let mut all = [Conversion::F32ToBf16; TABLE.len()];
        let mut i = 0;
        while i < TABLE.len() {
            all[i] = TABLE[i].0;
            i += 1;
        }
        all
    };

    /// This conversion's row of the table.
    fn row(self) -> &'static (Conversion, Dtype, Dtype, Kernel) {
        // The table lists every variant once, in declaration order (tested).
        &TABLE[self as usize]
    }

    /// The conversion from `src` to `dst`, if there is one.
    pub fn between(src: Dtype, dst: Dtype) -> Option<Conversion> {
        TABLE
            .iter()
            .find(|(_, s, d, _)| *s == src && *d == dst)
            .map(|row| row.0)
    }

    /// The source dtype.
    pub fn src(self) -> Dtype {
        self.row().1
    }

    /// The output dtype.
    pub fn dst(self) -> Dtype {
        self.row().2
    }

    /// Bytes per source element.
    pub fn src_size(self) -> u64 {
        elem_size(self.src())
    }

    /// Bytes per output element: the output dtype's (2 for every target so far; 1 for an
    /// FP8 one).
    pub fn dst_size(self) -> u64 {
        elem_size(self.dst())
    }

    /// Does a finite source value of magnitude `max_abs` become infinite?
    pub fn overflows(self, max_abs: f64) -> bool {
        match self {
            // Every f16 value is a bf16 value.
            Conversion::F16ToBf16 => false,
            Conversion::F32ToBf16 | Conversion::F64ToBf16 => max_abs >= BF16_OVERFLOW,
            Conversion::F32ToF16 | Conversion::F64ToF16 | Conversion::Bf16ToF16 => {
                max_abs >= F16_OVERFLOW
            }
        }
    }

    /// A conversion whose source dtype is `d` (F32, F16 or BF16), for passes that read `d`
    /// whatever it becomes (a scan of an FP8 target's weights).
    pub fn from_src(d: Dtype) -> Option<Conversion> {
        match d {
            Dtype::F32 => Some(Conversion::F32ToBf16),
            Dtype::F16 => Some(Conversion::F16ToBf16),
            Dtype::BF16 => Some(Conversion::Bf16ToF16),
            Dtype::F64 => Some(Conversion::F64ToBf16),
            _ => None,
        }
    }

    /// The kernel that performs this conversion.
    pub fn kernel(self) -> Kernel {
        self.row().3
    }
}

/// What happens to one tensor's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Copy,
    Convert(Conversion),
    /// An FP8 target's weight: E4M3 bytes, and its scale (a tensor of its own, written by the
    /// conversion as each group is done: see `convert::Job`).
    Quantize(crate::quant::Quant),
    /// An FP8 input's weight: E4M3 times its scale, in the target dtype (`convert::Job`
    /// reads the scale beside it).
    Dequantize(crate::quant::Deq),
}

impl Action {
    /// Bytes per element on each side: (1, 1) for a copy, whatever its dtype.
    pub fn sizes(self) -> (u64, u64) {
        match self {
            Action::Copy => (1, 1),
            Action::Convert(c) => (c.src_size(), c.dst_size()),
            Action::Quantize(q) => (q.size(), 1),
            Action::Dequantize(d) => (1, d.out_size()),
        }
    }

    /// Does this action change the tensor's dtype?
    pub fn converts(self) -> bool {
        !matches!(self, Action::Copy)
    }

    /// Output bytes for `len` source bytes.
    pub fn out_len(self, len: u64) -> u64 {
        if let Action::Dequantize(d) = self {
            // Packed codes: whole granules (rows) in, whole rows out.
            return d.out_len(len);
        }
        let (s, d) = self.sizes();
        len / s * d
    }

    /// Copy or convert `src` into `dst`. A quantized weight never comes here: its scale is
    /// written beside it (`convert::Job::quantize`), and the batches leave it out.
    pub fn apply(self, isa: Isa, src: &[u8], dst: &mut [u8]) {
        match self {
            Action::Copy => dst.copy_from_slice(src),
            Action::Convert(c) => c.kernel()(isa, src, dst),
            Action::Quantize(_) | Action::Dequantize(_) => {
                unreachable!("FP8 weights are not batched")
            }
        }
    }
}

/// The action for a source dtype under a target (before any `keep` rule).
pub fn action_for(dtype: Dtype, target: Target, from_bf16: bool) -> Action {
    match target.dtype().and_then(|d| Conversion::between(dtype, d)) {
        Some(Conversion::Bf16ToF16) if !from_bf16 => Action::Copy,
        Some(c) => Action::Convert(c),
        None => Action::Copy,
    }
}

/// Sort key for output grouping: widest element first, sub-byte dtypes last.
pub fn width_rank(d: Dtype) -> usize {
    let bits = d.bitsize();
    if bits.is_multiple_of(8) {
        bits
    } else {
        0
    }
}

/// Bytes per element, 1 for sub-byte dtypes (whose tensors are compared byte by byte).
pub fn elem_size(d: Dtype) -> u64 {
    (d.bitsize() / 8).max(1) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lists_every_conversion_once_in_order() {
        for (i, row) in TABLE.iter().enumerate() {
            assert_eq!(row.0 as usize, i, "{:?}", row.0);
            assert_eq!(Conversion::between(row.1, row.2), Some(row.0));
        }
        for c in Conversion::ALL {
            // Each variant's match arm (compile-checked exhaustive) is in the table.
            let n = match c {
                Conversion::F32ToBf16
                | Conversion::F16ToBf16
                | Conversion::F64ToBf16
                | Conversion::F32ToF16
                | Conversion::F64ToF16
                | Conversion::Bf16ToF16 => c as usize,
            };
            assert_eq!(TABLE[n].0, c);
        }
        let sizes: Vec<_> = Conversion::ALL
            .iter()
            .map(|c| (c.src_size(), c.dst_size()))
            .collect();
        assert_eq!(sizes, [(4, 2), (2, 2), (8, 2), (4, 2), (8, 2), (2, 2)]);
    }

    #[test]
    fn actions_per_target() {
        use Conversion::*;
        let cases = [
            (Dtype::F32, Target::Bf16, false, Action::Convert(F32ToBf16)),
            (Dtype::F16, Target::Bf16, false, Action::Convert(F16ToBf16)),
            (Dtype::F64, Target::Bf16, false, Action::Convert(F64ToBf16)),
            (Dtype::BF16, Target::Bf16, true, Action::Copy),
            (Dtype::F32, Target::F16, false, Action::Convert(F32ToF16)),
            (Dtype::F64, Target::F16, false, Action::Convert(F64ToF16)),
            (Dtype::BF16, Target::F16, false, Action::Copy),
            (Dtype::BF16, Target::F16, true, Action::Convert(Bf16ToF16)),
            (Dtype::F16, Target::F16, true, Action::Copy),
            (Dtype::I64, Target::F16, true, Action::Copy),
            (Dtype::F32, Target::Keep, false, Action::Copy),
            (Dtype::F64, Target::Keep, true, Action::Copy),
        ];
        for (d, t, from_bf16, want) in cases {
            assert_eq!(action_for(d, t, from_bf16), want, "{d:?} {t:?}");
        }
    }
}
