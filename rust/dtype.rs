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
/// (`dst.len() == src.len() / src_size * 2`).
pub type Kernel = fn(Isa, &[u8], &mut [u8]);

/// The smallest magnitude that rounds to infinity in bf16: the f32 midpoint 0x7F7F8000
/// between the largest bf16 (0x7F7F, odd) and 2^128, which ties upwards: 2^128 - 2^119.
pub const BF16_OVERFLOW: f64 = 339_617_752_923_046_005_526_922_703_901_628_039_168.0;
/// The smallest magnitude that rounds to infinity in f16: 65520, the midpoint between
/// 65504 (0x7BFF, odd) and 2^16, which ties upwards.
pub const F16_OVERFLOW: f64 = 65520.0;

impl Conversion {
    /// The conversion from `src` to `dst`, if there is one.
    pub fn between(src: Dtype, dst: Dtype) -> Option<Conversion> {
        use Conversion::*;
        Some(match (src, dst) {
            (Dtype::F32, Dtype::BF16) => F32ToBf16,
            (Dtype::F16, Dtype::BF16) => F16ToBf16,
            (Dtype::F64, Dtype::BF16) => F64ToBf16,
            (Dtype::F32, Dtype::F16) => F32ToF16,
            (Dtype::F64, Dtype::F16) => F64ToF16,
            (Dtype::BF16, Dtype::F16) => Bf16ToF16,
            _ => return None,
        })
    }

    /// Bytes per source element.
    pub fn src_size(self) -> u64 {
        match self {
            Conversion::F16ToBf16 | Conversion::Bf16ToF16 => 2,
            Conversion::F32ToBf16 | Conversion::F32ToF16 => 4,
            Conversion::F64ToBf16 | Conversion::F64ToF16 => 8,
        }
    }

    /// Bytes per output element (every target is 16-bit).
    pub const fn dst_size(self) -> u64 {
        2
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

    /// The kernel that performs this conversion.
    pub fn kernel(self) -> Kernel {
        match self {
            Conversion::F32ToBf16 => kernels::f32_to_bf16,
            Conversion::F16ToBf16 => kernels::f16_to_bf16,
            Conversion::F64ToBf16 => kernels::f64_to_bf16,
            Conversion::F32ToF16 => kernels::f32_to_f16,
            Conversion::F64ToF16 => kernels::f64_to_f16,
            Conversion::Bf16ToF16 => kernels::bf16_to_f16,
        }
    }
}

/// What happens to one tensor's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Copy,
    Convert(Conversion),
}

impl Action {
    /// Bytes per element on each side: (1, 1) for a copy, whatever its dtype.
    pub fn sizes(self) -> (u64, u64) {
        match self {
            Action::Copy => (1, 1),
            Action::Convert(c) => (c.src_size(), c.dst_size()),
        }
    }

    /// Output bytes for `len` source bytes.
    pub fn out_len(self, len: u64) -> u64 {
        let (s, d) = self.sizes();
        len / s * d
    }

    /// Copy or convert `src` into `dst`.
    pub fn apply(self, isa: Isa, src: &[u8], dst: &mut [u8]) {
        match self {
            Action::Copy => dst.copy_from_slice(src),
            Action::Convert(c) => c.kernel()(isa, src, dst),
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
