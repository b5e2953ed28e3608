//! Convert and measure in one pass: the kernel's output and `numerics::measure`'s report for
//! it, without reading the piece a second time.
//!
//! `convert_and_measure` writes exactly what the kernel writes and returns exactly the
//! `Numerics` that `numerics::measure` gives for the result (same counts, bit-identical
//! errors), for every input, ISA and MXCSR flush mode. It gets there cheaply by working on
//! blocks of `BLOCK` elements and assuming each block is *plain*:
//!
//! - every error is finite: no NaN or infinite input, no overflow;
//! - no underflow and no subnormal output, except F16 targets' subnormals: every non-zero
//!   |x| is at least 2^-102 for BF16 targets (from F16 sources anything goes: f16 values
//!   are normal in bf16), and above 2^-25 for F16 targets;
//! - F64 sources also stay below 2^128.
//!
//! Then |y - x| in the source's float format is exact and zero or normal whatever the
//! FTZ/DAZ bits (y is within a factor of 2 of x, so Sterbenz's lemma, or y = 0), and the
//! only count to take is F16 targets' subnormals, a range of |x|. The absolute error is the
//! largest |y - x|: one subtraction per lane. The relative error divides only in lanes that
//! may beat the largest so far, R: `fma(|x|, R, -|y - x|)` is negative exactly when
//! |y - x| > R |x| (the one rounding keeps the sign, and FTZ flushes to a zero of the
//! right sign), and a lane with |y - x| <= R |x| cannot round to a quotient above R. After
//! the first few vectors of a call R is near the maximum and divisions are rare; equal
//! ratios (quantised data) never divide.
//!
//! The SIMD loops convert without the NaN rule (a NaN makes its block not plain). A block
//! that turns out not plain is converted again by the kernel and measured by
//! `numerics::measure` while in L1, so the rare cases run the reference code. The fast
//! loops: scalar, AVX2 (with FMA) and AVX-512 for F32, F16 and BF16 sources, AVX-512 for
//! F64 sources (elsewhere F64 takes kernel + measure per 16 KiB, as the kernels have no AVX2
//! F64 path either).
#![deny(unsafe_op_in_unsafe_fn)]

use crate::dtype::Conversion;
use crate::kernels::{self, Isa};
use crate::numerics::{self, Numerics};

/// Converts `src` into `dst` as the kernel for `conv` does and returns what
/// `numerics::measure(conv, src, dst)` would report for the result.
///
/// Lengths as the kernels take them: `dst.len() == src.len() / conv.src_size() *
/// conv.dst_size()`; with
/// mismatched lengths only the elements both sides hold are converted and measured, and the
/// rest of `dst` is left alone. Any alignment. `isa` as for the kernels (an ISA this CPU
/// lacks runs the scalar code). Reports of pieces merge (`Numerics::merge`) into the
/// report of the whole. Large calls are cheaper than many small ones: each call starts
/// with no maximum relative error, so its first vectors divide (one call per 16 KiB costs
/// about 5-10% more in cache than one call over the same bytes).
pub fn convert_and_measure(isa: Isa, conv: Conversion, src: &[u8], dst: &mut [u8]) -> Numerics {
    let (size, out) = (conv.src_size() as usize, conv.dst_size() as usize);
    let n = (src.len() / size).min(dst.len() / out);
    let (src, dst) = (&src[..n * size], &mut dst[..n * out]);
    // The kernels run with the ISA asked for, the fast loops with what they can use.
    let (kernel_isa, isa) = (isa.usable(), lanes(isa));
    let exact = |s: &[u8], d: &mut [u8]| exact(kernel_isa, conv, s, d);
    let Some(step) = step(isa, conv) else {
        let mut total = Numerics::default();
        for (s, d) in src.chunks(2048 * size).zip(dst.chunks_mut(2048 * out)) {
            total.merge(&exact(s, d));
        }
        return total;
    };
    let mut total = Numerics::default();
    // A block that is not plain is likely followed by more (a tensor of -inf, or of tiny
    // values): after one, the next 1, 3, 7 ... 63 blocks go straight to the kernel and
    // measure, so that such data costs at most ~2% more than kernel + measure.
    let (mut skip, mut backoff) = (0u32, 0u32);
    for (s, d) in src.chunks(BLOCK * size).zip(dst.chunks_mut(BLOCK * out)) {
        let whole = d.len() / out / step * step;
        let (s, s_tail) = s.split_at(whole * size);
        let (d, d_tail) = d.split_at_mut(whole * out);
        if whole > 0 && skip > 0 {
            skip -= 1;
            total.merge(&exact(s, d));
        } else if whole > 0 {
            match fast_block(isa, conv, s, d, total.max_rel_error) {
                Some(block) => {
                    total.merge(&block);
                    backoff = 0;
                }
                None => {
                    total.merge(&exact(s, d));
                    backoff = (2 * backoff + 1).min(63);
                    skip = backoff;
                }
            }
        }
        if !d_tail.is_empty() {
            total.merge(&exact(s_tail, d_tail));
        }
    }
    total
}

/// The ISA the fused loops run with: the AVX2 loop also needs FMA (every AVX2 CPU we know
/// of has it; without it the scalar loop runs).
fn lanes(isa: Isa) -> Isa {
    match isa.usable() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if !is_x86_feature_detected!("fma") => Isa::Scalar,
        other => other,
    }
}

/// Elements per step of `isa`'s fast loop for `conv`; None where there is none.
fn step(isa: Isa, conv: Conversion) -> Option<usize> {
    use Conversion::*;
    // Every conversion named: one without fast loops (a new target's) returns None here.
    let f64_source = match conv {
        F64ToBf16 | F64ToF16 => true,
        F32ToBf16 | F16ToBf16 | F32ToF16 | Bf16ToF16 => false,
    };
    match isa {
        Isa::Avx512 if f64_source => Some(16),
        Isa::Avx512 => Some(32),
        _ if f64_source => None,
        Isa::Avx2 => Some(16),
        Isa::Scalar => Some(1),
    }
}

/// Elements per block: a block's source (4 KiB of F32) and output stay in L1 for the rare
/// second look, and the per-block work (reductions, the plain check) stays near 2%.
const BLOCK: usize = 1024;

/// The fast loop over a block of whole steps, given the largest relative error so far:
/// the output, and the block's report (with that relative error or a larger one) if the
/// block is plain; None (the output then may be wrong) if not.
fn fast_block(
    isa: Isa,
    conv: Conversion,
    src: &[u8],
    dst: &mut [u8],
    rel: f64,
) -> Option<Numerics> {
    use Conversion::*;
    // For F32, F16 and BF16 sources the relative errors are f32s widened: `as f32` is exact.
    let r32 = rel as f32;
    let summary = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: lanes() gives Avx512 only when the CPU has avx512f and avx512bw; callers
        // pass whole steps (step()), and a source of as many elements as dst holds.
        Isa::Avx512 => unsafe {
            match conv {
                F32ToBf16 => x86::block32_avx512::<SRC_F32, false>(src, dst, r32),
                F16ToBf16 => x86::block32_avx512::<SRC_F16, false>(src, dst, r32),
                F32ToF16 => x86::block32_avx512::<SRC_F32, true>(src, dst, r32),
                Bf16ToF16 => x86::block32_avx512::<SRC_BF16, true>(src, dst, r32),
                F64ToBf16 => x86::block64_avx512::<false>(src, dst, rel),
                F64ToF16 => x86::block64_avx512::<true>(src, dst, rel),
            }
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: lanes() gives Avx2 only when the CPU has avx2, f16c and fma; callers pass
        // whole steps (step()), and a source of as many elements as dst holds.
        Isa::Avx2 => unsafe {
            match conv {
                F32ToBf16 => x86::block32_avx2::<SRC_F32, false>(src, dst, r32),
                F16ToBf16 => x86::block32_avx2::<SRC_F16, false>(src, dst, r32),
                F32ToF16 => x86::block32_avx2::<SRC_F32, true>(src, dst, r32),
                Bf16ToF16 => x86::block32_avx2::<SRC_BF16, true>(src, dst, r32),
                F64ToBf16 | F64ToF16 => unreachable!("step() has no AVX2 loop for F64"),
            }
        },
        _ => match conv {
            F32ToBf16 => block32_scalar::<SRC_F32, false>(src, dst, r32),
            F16ToBf16 => block32_scalar::<SRC_F16, false>(src, dst, r32),
            F32ToF16 => block32_scalar::<SRC_F32, true>(src, dst, r32),
            Bf16ToF16 => block32_scalar::<SRC_BF16, true>(src, dst, r32),
            F64ToBf16 | F64ToF16 => unreachable!("step() has no scalar loop for F64"),
        },
    }?;
    Some(Numerics {
        elements: dst.len() as u64 / conv.dst_size(),
        subnormal: summary.subnormal,
        max_abs_error: summary.max_abs_error,
        max_rel_error: summary.max_rel_error,
        ..Numerics::default()
    })
}

/// What a plain block adds to the report (nothing overflows, underflows or is special).
struct Summary {
    /// F16 targets' subnormal outputs.
    subnormal: u64,
    /// The largest |y - x|, exact.
    max_abs_error: f64,
    /// The largest relative error: the block's, or the one the block was given.
    max_rel_error: f64,
}

/// The reference way: the kernel for `isa`, then `numerics::measure` over its output (from
/// L1), with the best ISA as `convert` runs it (its report does not depend on the ISA).
fn exact(isa: Isa, conv: Conversion, src: &[u8], dst: &mut [u8]) -> Numerics {
    conv.kernel()(isa, src, dst);
    numerics::measure(conv, src, dst)
}

// ---- the plain-block rules, as f32 bits (F32, F16, BF16 sources) and f64 bits (F64) -----

/// How the source of an f32-family conversion is read, as f32 bits (exact widening).
const SRC_F32: u8 = 0;
const SRC_F16: u8 = 1;
const SRC_BF16: u8 = 2;

const fn src_size(src: u8) -> usize {
    if src == SRC_F32 {
        4
    } else {
        2
    }
}

/// The lowest t = |x| - 1 (zero wraps to the top) of a plain block: non-zero |x| above
/// 2^-25 for F16 targets (2^-25 ties to even 0); at least 2^-102 for BF16 targets, where
/// |y - x| >= 2^-125 stays normal; anything from F16 sources (errors are multiples of
/// 2^-47).
const fn low_t(src: u8, f16_out: bool) -> Option<u32> {
    if f16_out {
        Some(0x3300_0000)
    } else if src == SRC_F16 {
        None
    } else {
        Some((25 << 23) - 1)
    }
}

/// t < SMALL_T exactly when 0 < |x| < 0x387F_E000, the inputs whose f16 is zero or
/// subnormal (0x387F_E000 = 2^-14 - 2^-25, the midpoint below 2^-14, ties up to it: 0x3FF is
/// odd). In a plain block these are the subnormal outputs.
const SMALL_T: u32 = 0x387F_DFFF;

/// BF16 -> F16 is exact at and above f16's smallest normal (8 significant bits fit in 11),
/// so its relative error, which only counts such inputs, is 0 in every plain block.
const fn rel_check(src: u8, f16_out: bool) -> bool {
    !(src == SRC_BF16 && f16_out)
}

/// The target's smallest normal as f32 bits: relative errors count inputs at or above it.
const fn tiny(f16_out: bool) -> u32 {
    if f16_out {
        0x3880_0000
    } else {
        0x0080_0000
    }
}

/// F64 sources, as f64 bits: the lowest t of a plain block (2^-25 for F16 targets: rounding
/// to odd at f32 precision keeps x <= 2^-25 at or below 0x3300_0000; 2^-102 for BF16), the
/// bound |x| stays below (2^128: the f32 rounded to odd is normal or zero, computed by one
/// shift), SMALL_T (x rounds to odd below 0x387F_E000 exactly when x < 2^-14 - 2^-25) and
/// the smallest normals.
const fn low_t64(f16_out: bool) -> u64 {
    if f16_out {
        (1023 - 25) << 52
    } else {
        ((1023 - 102) << 52) - 1
    }
}
const HIGH64: u64 = (1023 + 128) << 52;
const SMALL_T64: u64 = 0x3F0F_FC00_0000_0000 - 1;
const fn tiny64(f16_out: bool) -> u64 {
    if f16_out {
        (1023 - 14) << 52
    } else {
        (1023 - 126) << 52
    }
}

// ---- scalar ---------------------------------------------------------------------------

/// The scalar loop: the kernels' element rules and the plain-block statistics, written
/// without branches and with operations SSE2 has, so that LLVM vectorises it for the
/// baseline target. Lanes whose relative error may exceed `rel` are found with a margin
/// instead of an FMA (see `scalar32`); if there are any, a second loop over the block (in
/// L1) divides.
fn block32_scalar<const SRC: u8, const F16_OUT: bool>(
    src: &[u8],
    dst: &mut [u8],
    rel: f32,
) -> Option<Summary> {
    if SRC == SRC_F32 {
        scalar32::<4, SRC, F16_OUT>(src.as_chunks().0, dst.as_chunks_mut().0, rel)
    } else {
        scalar32::<2, SRC, F16_OUT>(src.as_chunks().0, dst.as_chunks_mut().0, rel)
    }
}

/// A source element as f32 bits, its output, and the output as f32 bits.
#[inline(always)]
fn scalar_lane<const N: usize, const SRC: u8, const F16_OUT: bool>(s: [u8; N]) -> (u32, u16, u32) {
    let x = match SRC {
        SRC_F32 => u32::from_le_bytes([s[0], s[1], s[2], s[3]]),
        SRC_F16 => kernels::f32_from_f16(u16::from_le_bytes([s[0], s[1]])),
        _ => u32::from(u16::from_le_bytes([s[0], s[1]])) << 16,
    };
    if F16_OUT {
        let o = kernels::f16_from_f32(x);
        (x, o, kernels::f32_from_f16(o))
    } else {
        let o = kernels::bf16_from_f32(x);
        (x, o, u32::from(o) << 16)
    }
}

#[inline(always)]
fn scalar32<const N: usize, const SRC: u8, const F16_OUT: bool>(
    src: &[[u8; N]],
    dst: &mut [[u8; 2]],
    rel: f32,
) -> Option<Summary> {
    let tiny = tiny(F16_OUT);
    // rel less 32 units in its last place, 2^-19 of it or more (rel is 0 or at least 2^-24,
    // the smallest non-zero quotient of a distance and a 24-bit significand). A lane with
    // err <= fl(r * |x|) has err / |x| <= rel: the product's rounding, in any MXCSR mode,
    // is far inside the margin, and flushing it to zero only flags more lanes.
    let r = if rel > 0.0 {
        f32::from_bits(rel.to_bits() - 32)
    } else {
        0.0
    };
    let (mut small, mut err_max, mut bad, mut flagged) = (0u32, 0i32, false, false);
    for (s, d) in src.iter().zip(dst.iter_mut()) {
        let (x, o, y) = scalar_lane::<N, SRC, F16_OUT>(*s);
        *d = o.to_le_bytes();
        let abs = x & 0x7FFF_FFFF;
        let t = abs.wrapping_sub(1);
        if let Some(low) = low_t(SRC, F16_OUT) {
            bad |= t < low;
        }
        // Wrapping: release builds check overflow, and a check stops vectorisation (a block
        // has at most BLOCK elements).
        small = small.wrapping_add(u32::from(t < SMALL_T));
        let err = (f32::from_bits(y) - f32::from_bits(x)).abs();
        // Integer max of the bits: LLVM vectorises it (a float max would need no-NaN).
        err_max = err_max.max(err.to_bits() as i32);
        flagged |= (abs >= tiny) & (err > r * f32::from_bits(abs));
    }
    if bad || err_max >= 0x7F80_0000 {
        return None;
    }
    let mut q_max = rel.to_bits() as i32;
    if rel_check(SRC, F16_OUT) && flagged {
        // Every eligible lane's quotient (the largest is the same); integer max of the
        // bits, which are those of non-negative floats, so that this loop vectorises too.
        for (s, d) in src.iter().zip(dst.iter()) {
            let (x, _, _) = scalar_lane::<N, SRC, F16_OUT>(*s);
            let o = u16::from_le_bytes(*d);
            let y = if F16_OUT {
                kernels::f32_from_f16(o)
            } else {
                u32::from(o) << 16
            };
            let abs = x & 0x7FFF_FFFF;
            let err = (f32::from_bits(y) - f32::from_bits(x)).abs();
            let q = (err / f32::from_bits(abs)).to_bits() as i32;
            q_max = q_max.max(if abs >= tiny { q } else { 0 });
        }
    }
    Some(Summary {
        subnormal: if F16_OUT { u64::from(small) } else { 0 },
        max_abs_error: f64::from(f32::from_bits(err_max as u32)),
        max_rel_error: f64::from(f32::from_bits(q_max as u32)),
    })
}

/// The AVX2 and AVX-512 loops: one generic routine per vector width, over the source kind
/// and the target (and one for F64 sources on AVX-512).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{low_t, low_t64, rel_check, src_size, tiny, tiny64, Summary};
    use super::{HIGH64, SMALL_T, SMALL_T64, SRC_F16, SRC_F32};
    use std::arch::x86_64::*;

    const MAG: i32 = 0x7FFF_FFFF;
    const SIGN: i32 = i32::MIN;
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

    /// Asks for the source line(s) 4 KiB ahead of the `bytes` at `p`. The fast loops do
    /// more work per byte than the kernels, and at DRAM sizes their time was the sum of the
    /// memory's and the arithmetic's; with this it overlaps (f32 -> f16 at 256 MiB: 5.5 ->
    /// 7.1 GB/s, the kernel's 7.5; no change in cache). A prefetch never faults, and the
    /// address is formed with wrapping_add, so running past the end is harmless.
    #[inline]
    #[target_feature(enable = "sse")]
    fn prefetch_ahead(p: *const u8, bytes: usize) {
        for line in (0..bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(4096 + line).cast());
        }
    }

    // ---- AVX-512: 16 lanes, two vectors per step ----------------------------------------

    /// Per-lane block accumulators: min of |x| - 1, max of |y - x| bits, and for F16
    /// targets the count of lanes that are zero or f16 normal (not subnormal).
    struct Acc512 {
        low: __m512i,
        err: __m512i,
        big: __m512i,
    }

    /// Sixteen source elements at `p` as f32 bits.
    ///
    /// # Safety
    /// `p` must point to 16 readable source elements (any alignment).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load512<const SRC: u8>(p: *const u8) -> __m512i {
        // SAFETY: the caller guarantees 16 elements at p; loadu accepts any alignment.
        unsafe {
            match SRC {
                SRC_F32 => _mm512_loadu_si512(p.cast()),
                // vcvtph2ps is exact (subnormal halves become normal floats) and ignores DAZ.
                SRC_F16 => _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))),
                _ => _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))),
            }
        }
    }

    /// bf16 rounding of non-NaN f32 lanes (the NaN rule is left to the kernel: a NaN makes
    /// the block not plain): the bf16 bits in the low half of each lane, and the output as
    /// f32 bits.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn bf16_plain512(x: __m512i) -> (__m512i, __m512i) {
        let odd = _mm512_test_epi32_mask(x, _mm512_set1_epi32(0x1_0000));
        let half = _mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF));
        let biased = _mm512_mask_add_epi32(half, odd, half, _mm512_set1_epi32(1));
        let y = _mm512_and_si512(biased, _mm512_set1_epi32(-0x1_0000));
        (_mm512_srli_epi32::<16>(biased), y)
    }

    /// f16 rounding (the immediate's nearest-even; subnormals kept whatever FTZ says; NaN
    /// payloads survive, which the kernel then corrects), and the output as f32 bits.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn f16_plain512(x: __m512i) -> (__m256i, __m512i) {
        let h = _mm512_cvtps_ph::<NEAREST>(_mm512_castsi512_ps(x));
        (h, _mm512_castps_si512(_mm512_cvtph_ps(h)))
    }

    /// Packs the low halves of the 32-bit lanes of `a` then `b`, in order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn pack_low_halves512(a: __m512i, b: __m512i) -> __m512i {
        let packed = _mm512_packus_epi32(a, b);
        _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), packed)
    }

    /// Adds sixteen lanes (source x, output y, both as f32 bits) to the block accumulators;
    /// returns |y - x|, |x| and the lanes whose relative error may exceed `r` (see the
    /// module comment).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn tally512<const SRC: u8, const F16_OUT: bool>(
        x: __m512i,
        y: __m512i,
        r: __m512,
        acc: &mut Acc512,
    ) -> (__m512i, __m512i, __mmask16) {
        let abs = _mm512_and_si512(x, _mm512_set1_epi32(MAG));
        let t = _mm512_sub_epi32(abs, _mm512_set1_epi32(1));
        if low_t(SRC, F16_OUT).is_some() {
            acc.low = _mm512_min_epu32(acc.low, t);
        }
        // Exact in a plain block (see the module comment); NaN or inf otherwise.
        let diff = _mm512_sub_ps(_mm512_castsi512_ps(y), _mm512_castsi512_ps(x));
        let err = _mm512_and_si512(_mm512_castps_si512(diff), _mm512_set1_epi32(MAG));
        acc.err = _mm512_max_epu32(acc.err, err);
        // F16 targets: zero or f16 normal, the lanes the relative error may count (the few
        // normal ones below 2^-14 are masked off where it divides).
        let mut big = !0;
        if F16_OUT {
            big = _mm512_cmpge_epu32_mask(t, _mm512_set1_epi32(SMALL_T as i32));
            acc.big = _mm512_mask_sub_epi32(acc.big, big, acc.big, _mm512_set1_epi32(-1));
        }
        if !rel_check(SRC, F16_OUT) {
            return (err, abs, 0);
        }
        // Negative where err > r |x|.
        let (abs_f, err_f) = (_mm512_castsi512_ps(abs), _mm512_castsi512_ps(err));
        let f = _mm512_castps_si512(_mm512_fmsub_ps(abs_f, r, err_f));
        (
            err,
            abs,
            _mm512_mask_test_epi32_mask(big, f, _mm512_set1_epi32(SIGN)),
        )
    }

    /// The largest relative error among the `flagged` lanes, rounded as `numerics::measure`
    /// rounds it: err / |x| in f32 (both normal, so it is the division of the integer
    /// distance by the significand, scaled by a power of two).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exact_rel512<const F16_OUT: bool>(err: __m512i, abs: __m512i, flagged: __mmask16) -> f32 {
        let eligible = _mm512_cmpge_epu32_mask(abs, _mm512_set1_epi32(tiny(F16_OUT) as i32));
        let (err, abs) = (_mm512_castsi512_ps(err), _mm512_castsi512_ps(abs));
        let q = _mm512_maskz_div_ps(flagged & eligible, err, abs);
        f32::from_bits(_mm512_reduce_max_epu32(_mm512_castps_si512(q)))
    }

    /// Converts a block of `dst.len() / 2` elements (a multiple of 32) and returns its
    /// summary, or None if it is not plain (its output may then be wrong for NaNs).
    ///
    /// # Safety
    /// The CPU must support avx512f and avx512bw; `src` must hold `dst.len() / 2` elements.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn block32_avx512<const SRC: u8, const F16_OUT: bool>(
        src: &[u8],
        dst: &mut [u8],
        mut rel: f32,
    ) -> Option<Summary> {
        let size = src_size(SRC);
        let n = dst.len() / 2;
        debug_assert!(n.is_multiple_of(32) && src.len() == n * size);
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let zero = _mm512_setzero_si512();
        let mut acc = Acc512 {
            low: _mm512_set1_epi32(-1),
            err: zero,
            big: zero,
        };
        let mut r = _mm512_set1_ps(rel);
        for i in (0..n).step_by(32) {
            // SAFETY: i + 32 <= n, so source elements i..i+32 and bytes 2i..2i+64 of dst are
            // in bounds; loads and stores are unaligned.
            prefetch_ahead(s.wrapping_add(size * i), 32 * size);
            let (xa, xb) = unsafe {
                (
                    load512::<SRC>(s.add(size * i)),
                    load512::<SRC>(s.add(size * (i + 16))),
                )
            };
            let (ya, yb) = if F16_OUT {
                let ((ha, ya), (hb, yb)) = (f16_plain512(xa), f16_plain512(xb));
                // SAFETY: as above.
                unsafe {
                    _mm256_storeu_si256(d.add(2 * i).cast(), ha);
                    _mm256_storeu_si256(d.add(2 * i + 32).cast(), hb);
                }
                (ya, yb)
            } else {
                let ((oa, ya), (ob, yb)) = (bf16_plain512(xa), bf16_plain512(xb));
                let out = pack_low_halves512(oa, ob);
                // SAFETY: as above.
                unsafe { _mm512_storeu_si512(d.add(2 * i).cast(), out) };
                (ya, yb)
            };
            let (ea, aa, fa) = tally512::<SRC, F16_OUT>(xa, ya, r, &mut acc);
            let (eb, ab, fb) = tally512::<SRC, F16_OUT>(xb, yb, r, &mut acc);
            if rel_check(SRC, F16_OUT) && (fa | fb) != 0 {
                let qa = exact_rel512::<F16_OUT>(ea, aa, fa);
                rel = rel.max(qa).max(exact_rel512::<F16_OUT>(eb, ab, fb));
                r = _mm512_set1_ps(rel);
            }
        }
        let low_bad = low_t(SRC, F16_OUT).is_some_and(|low| {
            _mm512_cmplt_epu32_mask(acc.low, _mm512_set1_epi32(low as i32)) != 0
        });
        let err_bits = _mm512_reduce_max_epu32(acc.err);
        if low_bad || err_bits >= 0x7F80_0000 {
            return None;
        }
        let big = if F16_OUT {
            _mm512_reduce_add_epi32(acc.big) as u32 as usize
        } else {
            n
        };
        Some(Summary {
            subnormal: (n - big) as u64,
            max_abs_error: f64::from(f32::from_bits(err_bits)),
            max_rel_error: f64::from(rel),
        })
    }

    // ---- AVX-512, F64 sources: 8 lanes per vector, two vectors per step -----------------

    /// As Acc512, in 64-bit lanes, with the max of |x| too (plain blocks stay below 2^128).
    struct Acc64 {
        low: __m512i,
        high: __m512i,
        err: __m512i,
        big: __m512i,
    }

    /// Sixteen f64 lanes (two vectors, bits) rounded to odd at f32 precision, the kernels'
    /// f32_round_to_odd for inputs whose f32 is normal (2^-126 <= |x| < 2^128) or zero:
    /// rebias the exponent, keep 23 mantissa bits, OR the dropped ones into the lsb, keep the
    /// sign.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn f32_round_to_odd_plain(a: __m512i, b: __m512i, abs_a: __m512i, abs_b: __m512i) -> __m512i {
        let rebias = _mm512_set1_epi64(896 << 52);
        let va = _mm512_srli_epi64::<29>(_mm512_sub_epi64(abs_a, rebias));
        let vb = _mm512_srli_epi64::<29>(_mm512_sub_epi64(abs_b, rebias));
        let dropped = _mm512_set1_epi64(0x1FFF_FFFF);
        let sticky = _mm512_kunpackb(
            _mm512_test_epi64_mask(abs_b, dropped).into(),
            _mm512_test_epi64_mask(abs_a, dropped).into(),
        );
        // The low halves of a's then b's 64-bit lanes (the magnitudes), and the high halves
        // (the signs in their top bits).
        let low = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let magnitude = _mm512_permutex2var_epi32(va, low, vb);
        let magnitude = _mm512_mask_or_epi32(magnitude, sticky, magnitude, _mm512_set1_epi32(1));
        let high = _mm512_add_epi32(low, _mm512_set1_epi32(1));
        let signs = _mm512_permutex2var_epi32(a, high, b);
        // Zeros (a high half without magnitude bits, in a plain block) keep their high half:
        // the signed zero. The others get magnitude | (signs & SIGN).
        let nonzero = _mm512_test_epi32_mask(signs, _mm512_set1_epi32(MAG));
        let sign = _mm512_set1_epi32(SIGN);
        _mm512_mask_ternarylogic_epi32::<0xEC>(signs, nonzero, magnitude, sign)
    }

    /// As tally512 for 8 f64 lanes: x the source bits, y the output widened to f64.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn tally64<const F16_OUT: bool>(
        abs: __m512i,
        x: __m512i,
        y: __m512d,
        r: __m512d,
        acc: &mut Acc64,
    ) -> (__m512i, __m512d) {
        let t = _mm512_sub_epi64(abs, _mm512_set1_epi64(1));
        acc.low = _mm512_min_epu64(acc.low, t);
        acc.high = _mm512_max_epu64(acc.high, abs);
        // Exact in a plain block: y is within a factor of 2 of x (Sterbenz), or 0.
        let diff = _mm512_sub_pd(y, _mm512_castsi512_pd(x));
        let err = _mm512_and_si512(_mm512_castpd_si512(diff), _mm512_set1_epi64(i64::MAX));
        acc.err = _mm512_max_epu64(acc.err, err);
        let (abs_f, err_f) = (_mm512_castsi512_pd(abs), _mm512_castsi512_pd(err));
        let f = if F16_OUT {
            let big = _mm512_cmpge_epu64_mask(t, _mm512_set1_epi64(SMALL_T64 as i64));
            acc.big = _mm512_mask_sub_epi64(acc.big, big, acc.big, _mm512_set1_epi64(-1));
            _mm512_maskz_fmsub_pd(big, abs_f, r, err_f)
        } else {
            _mm512_fmsub_pd(abs_f, r, err_f)
        };
        (err, f)
    }

    /// As exact_rel512, in f64 (numerics::measure divides in f64 for F64 sources).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exact_rel64<const F16_OUT: bool>(err: __m512i, abs: __m512i, f: __m512d) -> f64 {
        let f = _mm512_castpd_si512(f);
        let flagged = _mm512_test_epi64_mask(f, _mm512_set1_epi64(i64::MIN));
        let eligible = _mm512_cmpge_epu64_mask(abs, _mm512_set1_epi64(tiny64(F16_OUT) as i64));
        let (err, abs) = (_mm512_castsi512_pd(err), _mm512_castsi512_pd(abs));
        let q = _mm512_maskz_div_pd(flagged & eligible, err, abs);
        f64::from_bits(_mm512_reduce_max_epu64(_mm512_castpd_si512(q)))
    }

    /// As block32_avx512, for F64 sources, 16 elements per step.
    ///
    /// # Safety
    /// The CPU must support avx512f and avx512bw; `src` must hold `dst.len() / 2` elements.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn block64_avx512<const F16_OUT: bool>(
        src: &[u8],
        dst: &mut [u8],
        mut rel: f64,
    ) -> Option<Summary> {
        let n = dst.len() / 2;
        debug_assert!(n.is_multiple_of(16) && src.len() == n * 8);
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let zero = _mm512_setzero_si512();
        let mut acc = Acc64 {
            low: _mm512_set1_epi64(-1),
            high: zero,
            err: zero,
            big: zero,
        };
        let mut r = _mm512_set1_pd(rel);
        let mag = _mm512_set1_epi64(i64::MAX);
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= n, so bytes 8i..8i+128 of src and 2i..2i+32 of dst are in
            // bounds; loads and stores are unaligned.
            prefetch_ahead(s.wrapping_add(8 * i), 128);
            let (xa, xb) = unsafe {
                (
                    _mm512_loadu_si512(s.add(8 * i).cast()),
                    _mm512_loadu_si512(s.add(8 * i + 64).cast()),
                )
            };
            let (abs_a, abs_b) = (_mm512_and_si512(xa, mag), _mm512_and_si512(xb, mag));
            let x32 = f32_round_to_odd_plain(xa, xb, abs_a, abs_b);
            let y = if F16_OUT {
                let (h, y) = f16_plain512(x32);
                // SAFETY: as above.
                unsafe { _mm256_storeu_si256(d.add(2 * i).cast(), h) };
                y
            } else {
                let (o, y) = bf16_plain512(x32);
                let out = _mm512_cvtepi32_epi16(o);
                // SAFETY: as above.
                unsafe { _mm256_storeu_si256(d.add(2 * i).cast(), out) };
                y
            };
            // The outputs as f64, exactly (normal f32s: vcvtps2pd's DAZ cannot touch them).
            let ya = _mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_castsi512_ps(y)));
            let yb = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64::<1>(y)));
            let (ea, fa) = tally64::<F16_OUT>(abs_a, xa, ya, r, &mut acc);
            let (eb, fb) = tally64::<F16_OUT>(abs_b, xb, yb, r, &mut acc);
            let flags = _mm512_or_si512(_mm512_castpd_si512(fa), _mm512_castpd_si512(fb));
            if _mm512_test_epi64_mask(flags, _mm512_set1_epi64(i64::MIN)) != 0 {
                let qa = exact_rel64::<F16_OUT>(ea, abs_a, fa);
                rel = rel.max(qa).max(exact_rel64::<F16_OUT>(eb, abs_b, fb));
                r = _mm512_set1_pd(rel);
            }
        }
        let low = _mm512_set1_epi64(low_t64(F16_OUT) as i64);
        let low_bad = _mm512_cmplt_epu64_mask(acc.low, low) != 0;
        let high_bad = _mm512_cmpge_epu64_mask(acc.high, _mm512_set1_epi64(HIGH64 as i64)) != 0;
        let err_bits = _mm512_reduce_max_epu64(acc.err);
        if low_bad || high_bad || err_bits >= 0x7FF0_0000_0000_0000 {
            return None;
        }
        let big = if F16_OUT {
            _mm512_reduce_add_epi64(acc.big) as usize
        } else {
            n
        };
        Some(Summary {
            subnormal: (n - big) as u64,
            max_abs_error: f64::from_bits(err_bits),
            max_rel_error: rel,
        })
    }

    // ---- AVX2: 8 lanes, two vectors per step --------------------------------------------

    /// As Acc512 (the count subtracts compare results, which are -1 where true).
    struct Acc256 {
        low: __m256i,
        err: __m256i,
        big: __m256i,
    }

    /// Eight source elements at `p` as f32 bits.
    ///
    /// # Safety
    /// `p` must point to 8 readable source elements (any alignment).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load256<const SRC: u8>(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 8 elements at p; loadu accepts any alignment.
        unsafe {
            match SRC {
                SRC_F32 => _mm256_loadu_si256(p.cast()),
                SRC_F16 => _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(p.cast()))),
                _ => _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))),
            }
        }
    }

    /// As bf16_plain512.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn bf16_plain256(x: __m256i) -> (__m256i, __m256i) {
        let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
        let biased = _mm256_add_epi32(x, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
        let y = _mm256_and_si256(biased, _mm256_set1_epi32(-0x1_0000));
        (_mm256_srli_epi32::<16>(biased), y)
    }

    /// As f16_plain512.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn f16_plain256(x: __m256i) -> (__m128i, __m256i) {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_castsi256_ps(x));
        (h, _mm256_castps_si256(_mm256_cvtph_ps(h)))
    }

    /// As tally512; f has its sign bit set in the lanes to divide.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn tally256<const SRC: u8, const F16_OUT: bool>(
        x: __m256i,
        y: __m256i,
        r: __m256,
        acc: &mut Acc256,
    ) -> (__m256i, __m256i, __m256i) {
        let abs = _mm256_and_si256(x, _mm256_set1_epi32(MAG));
        let t = _mm256_sub_epi32(abs, _mm256_set1_epi32(1));
        if low_t(SRC, F16_OUT).is_some() {
            acc.low = _mm256_min_epu32(acc.low, t);
        }
        let diff = _mm256_sub_ps(_mm256_castsi256_ps(y), _mm256_castsi256_ps(x));
        let err = _mm256_and_si256(_mm256_castps_si256(diff), _mm256_set1_epi32(MAG));
        acc.err = _mm256_max_epu32(acc.err, err);
        let (abs_f, err_f) = (_mm256_castsi256_ps(abs), _mm256_castsi256_ps(err));
        let f = if rel_check(SRC, F16_OUT) {
            _mm256_castps_si256(_mm256_fmsub_ps(abs_f, r, err_f))
        } else {
            _mm256_setzero_si256()
        };
        if F16_OUT {
            // Unsigned t >= SMALL_T as a signed compare with both sides' top bits flipped.
            let tb = _mm256_xor_si256(t, _mm256_set1_epi32(SIGN));
            let above = _mm256_set1_epi32((SMALL_T - 1) as i32 ^ SIGN);
            let big = _mm256_cmpgt_epi32(tb, above);
            acc.big = _mm256_sub_epi32(acc.big, big);
            return (err, abs, _mm256_and_si256(big, f));
        }
        (err, abs, f)
    }

    /// As exact_rel512.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn exact_rel256<const F16_OUT: bool>(err: __m256i, abs: __m256i, f: __m256i) -> f32 {
        let flagged = _mm256_srai_epi32::<31>(f);
        let eligible = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(tiny(F16_OUT) as i32 - 1));
        let q = _mm256_div_ps(_mm256_castsi256_ps(err), _mm256_castsi256_ps(abs));
        let q = _mm256_and_si256(_mm256_castps_si256(q), _mm256_and_si256(flagged, eligible));
        f32::from_bits(to_lanes(q).into_iter().max().unwrap_or(0))
    }

    #[inline]
    #[target_feature(enable = "avx")]
    fn to_lanes(v: __m256i) -> [u32; 8] {
        let mut out = [0u32; 8];
        // SAFETY: out is 32 writable bytes; storeu accepts any alignment.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) };
        out
    }

    /// As block32_avx512, 16 elements per step.
    ///
    /// # Safety
    /// The CPU must support avx2, f16c and fma; `src` must hold `dst.len() / 2` elements.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn block32_avx2<const SRC: u8, const F16_OUT: bool>(
        src: &[u8],
        dst: &mut [u8],
        mut rel: f32,
    ) -> Option<Summary> {
        let size = src_size(SRC);
        let n = dst.len() / 2;
        debug_assert!(n.is_multiple_of(16) && src.len() == n * size);
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let zero = _mm256_setzero_si256();
        let mut acc = Acc256 {
            low: _mm256_set1_epi32(-1),
            err: zero,
            big: zero,
        };
        let mut r = _mm256_set1_ps(rel);
        for i in (0..n).step_by(16) {
            // SAFETY: i + 16 <= n, so source elements i..i+16 and bytes 2i..2i+32 of dst are
            // in bounds; loads and stores are unaligned.
            prefetch_ahead(s.wrapping_add(size * i), 16 * size);
            let (xa, xb) = unsafe {
                (
                    load256::<SRC>(s.add(size * i)),
                    load256::<SRC>(s.add(size * (i + 8))),
                )
            };
            let (ya, yb) = if F16_OUT {
                let ((ha, ya), (hb, yb)) = (f16_plain256(xa), f16_plain256(xb));
                // SAFETY: as above.
                unsafe {
                    _mm_storeu_si128(d.add(2 * i).cast(), ha);
                    _mm_storeu_si128(d.add(2 * i + 16).cast(), hb);
                }
                (ya, yb)
            } else {
                let ((oa, ya), (ob, yb)) = (bf16_plain256(xa), bf16_plain256(xb));
                // packus works per 128-bit lane; the values fit in 16 bits, so it only
                // reorders.
                let packed = _mm256_packus_epi32(oa, ob);
                let out = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
                // SAFETY: as above.
                unsafe { _mm256_storeu_si256(d.add(2 * i).cast(), out) };
                (ya, yb)
            };
            let (ea, aa, fa) = tally256::<SRC, F16_OUT>(xa, ya, r, &mut acc);
            let (eb, ab, fb) = tally256::<SRC, F16_OUT>(xb, yb, r, &mut acc);
            let flags = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_or_si256(fa, fb)));
            if rel_check(SRC, F16_OUT) && flags != 0 {
                let qa = exact_rel256::<F16_OUT>(ea, aa, fa);
                rel = rel.max(qa).max(exact_rel256::<F16_OUT>(eb, ab, fb));
                r = _mm256_set1_ps(rel);
            }
        }
        let (low, err, big) = (to_lanes(acc.low), to_lanes(acc.err), to_lanes(acc.big));
        let low_bad = low_t(SRC, F16_OUT).is_some_and(|t| low.iter().any(|&l| l < t));
        let err_bits = err.into_iter().max().unwrap_or(0);
        if low_bad || err_bits >= 0x7F80_0000 {
            return None;
        }
        let big = if F16_OUT {
            big.iter().map(|&c| c as usize).sum()
        } else {
            n
        };
        Some(Summary {
            subnormal: (n - big) as u64,
            max_abs_error: f64::from(f32::from_bits(err_bits)),
            max_rel_error: f64::from(rel),
        })
    }
}

#[cfg(test)]
mod tests {
    //! The fused pass against the kernel followed by `numerics::measure`: output bytes and
    //! the report, for every ISA this CPU has, unaligned, in pieces and under FTZ/DAZ.
    use super::*;
    use crate::testutil::Rng;
    use std::sync::atomic::{AtomicU64, Ordering};
    use Conversion::*;

    const SEED: u64 = 0x5EED_F05E_D000_0001;
    const ALL: [Conversion; 6] = [
        F32ToBf16, F16ToBf16, F64ToBf16, F32ToF16, F64ToF16, Bf16ToF16,
    ];

    fn size(c: Conversion) -> usize {
        c.src_size() as usize
    }

    fn to_bytes(c: Conversion, inputs: &[u64], offset: usize) -> Vec<u8> {
        let mut bytes = vec![0xA5; offset];
        for x in inputs {
            bytes.extend_from_slice(&x.to_le_bytes()[..size(c)]);
        }
        bytes
    }

    /// The kernel's output and `numerics::measure`'s report for it.
    fn reference(c: Conversion, src: &[u8]) -> (Vec<u8>, Numerics) {
        let mut dst = vec![0u8; src.len() / size(c) * 2];
        exact(Isa::Scalar, c, src, &mut dst);
        let n = numerics::measure(c, src, &dst);
        (dst, n)
    }

    /// The first difference between two outputs, for messages.
    fn first_difference(c: Conversion, src: &[u8], got: &[u8], want: &[u8]) -> String {
        let i = (0..want.len() / 2)
            .find(|&i| got[2 * i..2 * i + 2] != want[2 * i..2 * i + 2])
            .unwrap();
        let x = &src[i * size(c)..(i + 1) * size(c)];
        format!(
            "element {i}, input {x:02x?}: got {:02x?}, want {:02x?}",
            &got[2 * i..2 * i + 2],
            &want[2 * i..2 * i + 2]
        )
    }

    /// Fused equals kernel + measure for every ISA, with the source at offsets 0, 1 and 3
    /// and the output at 0 and 1 (unaligned both sides). Returns the report.
    fn check(c: Conversion, inputs: &[u64]) -> Numerics {
        let (want_out, want) = reference(c, &to_bytes(c, inputs, 0));
        for isa in Isa::available() {
            for (so, d_off) in [(0, 0), (1, 1), (3, 0), (0, 1)] {
                let src = to_bytes(c, inputs, so);
                let src = &src[so..];
                let mut buf = vec![0x5A; d_off + want_out.len()];
                let dst = &mut buf[d_off..];
                let got = convert_and_measure(isa, c, src, dst);
                assert!(
                    dst == &want_out[..],
                    "{c:?} {isa:?} src+{so} dst+{d_off}: {}",
                    first_difference(c, src, dst, &want_out)
                );
                assert_eq!(got, want, "{c:?} {isa:?} src+{so} dst+{d_off}");
            }
        }
        want
    }

    /// Fused over pieces cut at random places, merged, equals the whole.
    fn check_pieces(c: Conversion, inputs: &[u64], rng: &mut Rng) {
        let src = to_bytes(c, inputs, 0);
        let (want_out, want) = reference(c, &src);
        for isa in Isa::available() {
            for _ in 0..4 {
                let mut dst = vec![0u8; want_out.len()];
                let mut total = Numerics::default();
                let mut at = 0;
                while at < inputs.len() {
                    let len = match rng.below(4) {
                        0 => rng.below(40),
                        1 => rng.below(3000),
                        _ => rng.below(1 << 14),
                    } as usize;
                    let end = (at + len + 1).min(inputs.len());
                    let s = &src[at * size(c)..end * size(c)];
                    total.merge(&convert_and_measure(isa, c, s, &mut dst[at * 2..end * 2]));
                    at = end;
                }
                assert!(dst == want_out, "{c:?} {isa:?} in pieces");
                assert_eq!(total, want, "{c:?} {isa:?} in pieces");
            }
        }
    }

    // ---- inputs ------------------------------------------------------------------------

    /// Source bits of the finite value `x` (rounded to the source format by the kernels).
    fn bits_of(c: Conversion, x: f64) -> u64 {
        let f = (x as f32).to_bits();
        match c {
            F16ToBf16 => u64::from(kernels::f16_from_f32(f)),
            Bf16ToF16 => u64::from(kernels::bf16_from_f32(f)),
            F32ToBf16 | F32ToF16 => u64::from(f),
            F64ToBf16 | F64ToF16 => x.to_bits(),
        }
    }

    /// Random finite values, log-uniform over 2^lo .. 2^hi, random signs; every 16th zero.
    fn plain(c: Conversion, rng: &mut Rng, n: usize, lo: i32, hi: i32) -> Vec<u64> {
        (0..n)
            .map(|i| {
                if i % 16 == 5 {
                    return bits_of(c, 0.0) | (rng.next() & 1) << (8 * size(c) - 1);
                }
                let r = rng.next();
                let exp = (lo + (r >> 40) as i32 % (hi - lo)) + 1023;
                let x = f64::from_bits((r & 1 << 63) | (exp as u64) << 52 | (r & 0xF_FFFF_FFFF));
                bits_of(c, x)
            })
            .collect()
    }

    /// The specials and the values around every threshold: NaNs, infinities, subnormals,
    /// the plain bound 2^-102, f16's underflow and subnormal bounds, overflow midpoints.
    fn specials(c: Conversion) -> Vec<u64> {
        let mut out = Vec::new();
        let f32s: &[u32] = &[
            0x7F80_0000,
            0x7F80_0001,
            0x7FC0_0000,
            0x7FFF_FFFF,
            0x7F7F_FFFF,
            0x7F7F_8000,
            0x7F7F_7FFF,
            0x477F_F000,
            0x477F_EFFF,
            0x477F_E000,
            0x0000_0001,
            0x0000_8000,
            0x0001_8000,
            0x007F_FFFF,
            0x007F_8000,
            0x0080_0000,
            0x0C80_0000,
            0x0C7F_FFFF,
            0x0C80_0001,
            0x3300_0000,
            0x3300_0001,
            0x32FF_FFFF,
            0x387F_E000,
            0x387F_DFFF,
            0x3880_0000,
            0x387F_FFFF,
            0x3380_0000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_1000,
        ];
        for &u in f32s {
            for sign in [0, 0x8000_0000u32] {
                let u = u | sign;
                out.push(match c {
                    F16ToBf16 => u64::from(kernels::f16_from_f32(u)),
                    Bf16ToF16 => u64::from(u >> 16),
                    F32ToBf16 | F32ToF16 => u64::from(u),
                    F64ToBf16 | F64ToF16 => f64::from(f32::from_bits(u)).to_bits(),
                });
            }
        }
        if size(c) == 2 {
            out.extend([
                0x7C00, 0xFC00, 0x7E01, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0xFF81,
            ]);
        }
        if size(c) == 8 {
            out.extend([
                1,
                0x7FF0_0000_0000_0001,
                0x47F0_0000_0000_0000,
                0x3E60_0000_0000_0000,
            ]);
        }
        out
    }

    /// Plain values with a special value at random positions, about one per `spacing`
    /// elements: some blocks stay plain, others do not.
    fn sprinkled(c: Conversion, rng: &mut Rng, n: usize, spacing: u64) -> Vec<u64> {
        let specials = specials(c);
        let mut v = plain(c, rng, n, -30, 15);
        for x in v.iter_mut() {
            if rng.below(spacing) == 0 {
                *x = specials[rng.below(specials.len() as u64) as usize];
            }
        }
        v
    }

    fn random_bits(c: Conversion, rng: &mut Rng, n: usize) -> Vec<u64> {
        let mask = u64::MAX >> (64 - 8 * size(c));
        (0..n).map(|_| rng.next() & mask).collect()
    }

    /// For f32 sources: every high half with the low halves that decide rounding, in order
    /// (so that most blocks are plain).
    fn sampled_f32() -> Vec<u64> {
        let lows = [
            0, 1, 0x0FFF, 0x1000, 0x1001, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xFFFF,
        ];
        (0..=0xFFFF_u64)
            .flat_map(|hi| lows.iter().map(move |&lo| hi << 16 | lo))
            .collect()
    }

    fn scale() -> usize {
        if cfg!(debug_assertions) {
            1
        } else {
            8
        }
    }

    // ---- tests -------------------------------------------------------------------------

    #[test]
    fn sixteen_bit_sources_all_patterns() {
        let mut rng = Rng(SEED);
        for c in [F16ToBf16, Bf16ToF16] {
            let mut all: Vec<u64> = (0..=0xFFFF).collect();
            check(c, &all);
            // Shuffled: plain and non-plain patterns mixed in every block.
            for i in (1..all.len()).rev() {
                all.swap(i, rng.below(i as u64 + 1) as usize);
            }
            check(c, &all);
        }
    }

    #[test]
    fn f32_sources_sampled_and_random() {
        let mut rng = Rng(SEED ^ 1);
        for c in [F32ToBf16, F32ToF16] {
            check(c, &sampled_f32());
            check(c, &random_bits(c, &mut rng, 200_000 * scale()));
        }
    }

    #[test]
    fn every_conversion_plain_sprinkled_and_special() {
        println!("seed {SEED:#x}");
        let mut rng = Rng(SEED ^ 2);
        for c in ALL {
            let n = 100_000 * scale();
            // Wide ranges reach the low bound and f16's subnormals and overflow.
            check(c, &plain(c, &mut rng, n, -110, 20));
            check(c, &plain(c, &mut rng, n, -8, 8));
            check(c, &sprinkled(c, &mut rng, n, 3000));
            check(c, &sprinkled(c, &mut rng, n, 300));
            let specials = specials(c);
            check(c, &specials);
            let long: Vec<u64> = specials.iter().cycle().take(5000).copied().collect();
            check(c, &long);
            check(c, &random_bits(c, &mut rng, n));
        }
    }

    /// Tails of every length, at every source offset: the SIMD steps and the tail code meet
    /// each value in each position.
    #[test]
    fn short_lengths_and_tails() {
        let mut rng = Rng(SEED ^ 3);
        for c in ALL {
            let values = sprinkled(c, &mut rng, 200, 20);
            for len in 0..values.len() {
                check(c, &values[..len]);
            }
        }
    }

    /// Many equal maximum ratios (values 1 + 2^-8 that tie down, and others): ties never
    /// change the maximum, whatever the order.
    #[test]
    fn repeated_maxima_and_quantized_values() {
        let mut rng = Rng(SEED ^ 4);
        for c in ALL {
            let grid: Vec<u64> = (0..256)
                .map(|i| bits_of(c, (i as f64 - 128.0) * 0.013_7))
                .collect();
            let v: Vec<u64> = (0..50_000).map(|_| grid[rng.below(256) as usize]).collect();
            check(c, &v);
            let tie = bits_of(c, 1.0 + 2f64.powi(-8));
            let v: Vec<u64> = (0..5000)
                .map(|i| if i % 7 == 0 { tie } else { bits_of(c, 1.5) })
                .collect();
            check(c, &v);
        }
    }

    /// F64 inputs aimed at rounding decisions: the midpoints between neighbouring outputs
    /// (random neighbours, random signs), the f64s next to them and points a fraction of an
    /// f32 ulp away (where rounding to f32 first would land on the midpoint); and values
    /// around the plain bounds (2^-102, 2^128) and f16's thresholds.
    fn ties64(c: Conversion, rng: &mut Rng, n: usize) -> Vec<u64> {
        let f16_out = c == F64ToF16;
        let value = |b: u64| {
            if f16_out {
                f64::from(f32::from_bits(kernels::f32_from_f16(b as u16)))
            } else {
                f64::from(f32::from_bits((b as u32) << 16))
            }
        };
        let top = if f16_out { 0x7BFF } else { 0x7F7F };
        let mut out = Vec::new();
        while out.len() < n {
            let b = 1 + rng.below(top - 1);
            let (lo, hi) = (value(b), value(b + 1));
            let mid = (lo + hi) / 2.0;
            let sign = rng.next() & 1 << 63;
            let bits = mid.to_bits();
            for x in [
                bits,
                bits + 1,
                bits - 1,
                (mid + mid * 2f64.powi(-25)).to_bits(),
                (mid - mid * 2f64.powi(-25)).to_bits(),
                (mid + mid * 2f64.powi(-24)).to_bits(),
                (mid + mid * 2f64.powi(-30 - rng.below(20) as i32)).to_bits(),
            ] {
                out.push(x | sign);
            }
        }
        for edge in [
            low_t64(false) + 1,
            HIGH64,
            low_t64(true) + 1,
            SMALL_T64 + 1,
            tiny64(f16_out),
            0x47EF_F000_0000_0000,
            0x40EF_FE00_0000_0000,
        ] {
            for d in 0..4u64 {
                out.extend([edge + d, edge - 1 - d, (edge + d) | 1 << 63]);
            }
        }
        out
    }

    #[test]
    fn f64_ties_and_bounds() {
        let mut rng = Rng(SEED ^ 9);
        for c in [F64ToBf16, F64ToF16] {
            let mut v = ties64(c, &mut rng, 200_000 * scale());
            check(c, &v);
            // Shuffled among plain values: the bounds make blocks not plain at random.
            v.truncate(3000);
            let mut p = plain(c, &mut rng, 60_000, -30, 20);
            for x in v {
                let at = rng.below(p.len() as u64) as usize;
                p[at] = x;
            }
            check(c, &p);
        }
    }

    #[test]
    fn pieces_merge_to_the_whole() {
        let mut rng = Rng(SEED ^ 5);
        for c in ALL {
            let mut v = plain(c, &mut rng, 60_000, -110, 20);
            v.extend(sprinkled(c, &mut rng, 60_000, 2000));
            check_pieces(c, &v, &mut rng);
        }
    }

    /// The point of the exercise: plain blocks take the fast loop, on every ISA that has
    /// one, and give the reference's report.
    #[test]
    fn plain_blocks_take_the_fast_loop() {
        let mut rng = Rng(SEED ^ 6);
        for c in ALL {
            let v = plain(c, &mut rng, BLOCK, -24, 15);
            let src = to_bytes(c, &v, 0);
            let (want_out, want) = reference(c, &src);
            assert!(
                want.subnormal > 0 || !matches!(c, F32ToF16 | F64ToF16),
                "{c:?} {want:?}"
            );
            for isa in Isa::available() {
                let isa = lanes(isa);
                if step(isa, c).is_none() {
                    continue;
                }
                let mut dst = vec![0u8; BLOCK * 2];
                let got = fast_block(isa, c, &src, &mut dst, 0.0);
                let got = got.unwrap_or_else(|| panic!("{c:?} {isa:?}: block not plain"));
                assert!(dst == want_out, "{c:?} {isa:?}");
                assert_eq!(got, want, "{c:?} {isa:?}");
            }
        }
    }

    /// With MXCSR flush-to-zero and denormals-are-zero on, every ISA gives the results
    /// computed without them.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fused_ignores_flush_to_zero_and_denormals_are_zero() {
        let mut rng = Rng(SEED ^ 7);
        let mut cases = Vec::new();
        for c in ALL {
            let mut v = plain(c, &mut rng, 20_000, -104, -90);
            v.extend(plain(c, &mut rng, 20_000, -30, -10));
            v.extend(sprinkled(c, &mut rng, 20_000, 500));
            v.extend(random_bits(c, &mut rng, 20_000));
            let src = to_bytes(c, &v, 1);
            let (out, n) = reference(c, &src[1..]);
            cases.push((c, src, out, n));
        }
        let got: Vec<Vec<(Vec<u8>, Numerics)>> = crate::testutil::with_ftz_daz(|| {
            cases
                .iter()
                .map(|(c, src, out, _)| {
                    Isa::available()
                        .into_iter()
                        .map(|isa| {
                            let mut dst = vec![0u8; out.len()];
                            let n = convert_and_measure(isa, *c, &src[1..], &mut dst);
                            (dst, n)
                        })
                        .collect()
                })
                .collect()
        });
        for ((c, _, out, want), got) in cases.iter().zip(got) {
            for (isa, (dst, n)) in Isa::available().into_iter().zip(got) {
                assert!(&dst == out, "{c:?} {isa:?} under FTZ/DAZ");
                assert_eq!(&n, want, "{c:?} {isa:?} under FTZ/DAZ");
            }
        }
    }

    /// Mismatched lengths convert and measure what both sides hold and leave the rest.
    #[test]
    fn mismatched_lengths_stay_in_bounds() {
        let mut rng = Rng(SEED ^ 8);
        for c in ALL {
            let v = sprinkled(c, &mut rng, 3000, 100);
            let src = to_bytes(c, &v, 0);
            for isa in Isa::available() {
                for (src_len, dst_len) in [(3000, 10), (2999, 3000), (37, 3), (0, 8), (3000, 0)] {
                    let src_len = (src_len * size(c)).saturating_sub(usize::from(src_len % 7 == 0));
                    let mut dst = vec![0xEE; dst_len * 2 + 1];
                    let got = convert_and_measure(isa, c, &src[..src_len], &mut dst);
                    let k = (src_len / size(c)).min(dst.len() / 2);
                    let (want_out, want) = reference(c, &src[..k * size(c)]);
                    assert_eq!(&dst[..2 * k], &want_out[..], "{c:?} {isa:?}");
                    assert!(dst[2 * k..].iter().all(|&b| b == 0xEE), "{c:?} {isa:?}");
                    assert_eq!(got, want, "{c:?} {isa:?} {src_len} {dst_len}");
                }
            }
        }
    }

    /// All 2^32 f32 patterns, in batches of 2^16 consecutive ones (most of them plain blocks),
    /// on every thread: fused against kernel + measure, output and report per batch.
    fn sweep_all_f32(c: Conversion) {
        const BATCH: usize = 1 << 16;
        let next = AtomicU64::new(0);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let isas = Isa::available();
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    let mut src = vec![0u8; BATCH * 4];
                    let mut want = vec![0u8; BATCH * 2];
                    let mut got = vec![0u8; BATCH * 2];
                    loop {
                        let start = next.fetch_add(BATCH as u64, Ordering::Relaxed);
                        if start >= 1 << 32 {
                            break;
                        }
                        for (i, s) in src.as_chunks_mut::<4>().0.iter_mut().enumerate() {
                            *s = (start as u32).wrapping_add(i as u32).to_le_bytes();
                        }
                        let n = exact(Isa::detect(), c, &src, &mut want);
                        for &isa in &isas {
                            let m = convert_and_measure(isa, c, &src, &mut got);
                            assert!(
                                got == want,
                                "{c:?} {isa:?} batch {start:#x}: {}",
                                first_difference(c, &src, &got, &want)
                            );
                            assert_eq!(m, n, "{c:?} {isa:?} batch {start:#x}");
                        }
                    }
                });
            }
        });
    }

    #[test]
    #[cfg_attr(
        debug_assertions,
        ignore = "exhaustive sweep runs in release: cargo test --release"
    )]
    fn f32_to_bf16_all_floats() {
        sweep_all_f32(F32ToBf16);
    }

    #[test]
    #[cfg_attr(
        debug_assertions,
        ignore = "exhaustive sweep runs in release: cargo test --release"
    )]
    fn f32_to_f16_all_floats() {
        sweep_all_f32(F32ToF16);
    }
}
