//! Dtype conversion kernels: scalar references plus SIMD paths chosen at run time.
//!
//! Every conversion rounds once, to nearest with ties to even. Subnormals are kept (never
//! flushed), overflow goes to infinity and a NaN becomes the quiet NaN of its sign. For
//! F32 and F16 sources the bf16 bits equal ml_dtypes' `astype(bfloat16)`.
//!
//! The SIMD paths use integer arithmetic and the exact F16C / AVX-512F half conversions, never
//! the AVX-512 BF16 instructions (they flush subnormals). No result depends on the MXCSR
//! rounding or flush-to-zero / denormals-are-zero bits, which another library in a Python
//! process may have set; a test runs every kernel with FTZ and DAZ on.
#![deny(unsafe_op_in_unsafe_fn)]

use std::sync::OnceLock;

/// An instruction set a slice kernel can run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    /// AVX2 with F16C.
    Avx2,
    /// AVX-512F and AVX-512BW, on top of AVX2 and F16C.
    Avx512,
}

impl Isa {
    /// The best instruction set this CPU offers, detected once.
    pub fn detect() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(detect_best)
    }

    /// Every instruction set usable on this CPU, `Scalar` first.
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|isa| isa.rank() <= Isa::detect().rank())
            .collect()
    }

    /// The lower-case name reports show: "scalar", "avx2" or "avx512".
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Each level needs every feature of the levels below it, so support is a prefix.
    fn rank(self) -> u8 {
        match self {
            Isa::Scalar => 0,
            Isa::Avx2 => 1,
            Isa::Avx512 => 2,
        }
    }

    /// `self` if this CPU supports it, else `Scalar`: a kernel never runs unsupported code.
    pub(crate) fn usable(self) -> Isa {
        if self.rank() <= Isa::detect().rank() {
            self
        } else {
            Isa::Scalar
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn detect_best() -> Isa {
    let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
    if avx2 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
        Isa::Avx512
    } else if avx2 {
        Isa::Avx2
    } else {
        Isa::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_best() -> Isa {
    Isa::Scalar
}

/// Rounds f32 bits to bf16 bits; a NaN becomes `sign | 0x7FC0`.
#[inline(always)]
pub fn bf16_from_f32(u: u32) -> u16 {
    // Adding 0x7FFF plus the kept lsb carries into bit 16 exactly when the dropped half is
    // above the midpoint, or on it with an odd kept part; a carry into the exponent is right.
    let rounded = (u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16) as u16;
    let quiet = ((u >> 16) as u16 & 0x8000) | 0x7FC0;
    // A NaN with its payload only in the low half would otherwise truncate to infinity.
    if u & 0x7FFF_FFFF > 0x7F80_0000 {
        quiet
    } else {
        rounded
    }
}

/// Rounds f16 bits to bf16 bits (through the exact f32 value).
#[inline(always)]
pub fn bf16_from_f16(h: u16) -> u16 {
    bf16_from_f32(f32_from_f16(h))
}

/// Rounds f64 bits to bf16 bits, once: round to odd at f32 precision keeps the sticky
/// information the second rounding needs. A NaN becomes `sign | 0x7FC0`.
#[inline(always)]
pub fn bf16_from_f64(x: u64) -> u16 {
    bf16_from_f32(f32_round_to_odd(x))
}

/// Rounds f32 bits to IEEE binary16 bits; |x| >= 65520 overflows to infinity, a NaN
/// becomes `sign | 0x7E00`.
#[inline(always)]
pub fn f16_from_f32(u: u32) -> u16 {
    let sign = (u >> 16) as u16 & 0x8000;
    let abs = u & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        sign | 0x7E00
    } else if abs >= 0x477F_F000 {
        // 65520 is the midpoint between 65504 and 2^16 and rounds (to even) upwards.
        sign | 0x7C00
    } else if abs >= 0x3880_0000 {
        // Normal in f16: rebias the exponent from 127 to 15, then round off 13 bits as in
        // bf16_from_f32; a carry into the exponent is right.
        let rebiased = abs - 0x3800_0000;
        sign | (rebiased.wrapping_add(0xFFF + ((rebiased >> 13) & 1)) >> 13) as u16
    } else {
        // Subnormal in f16 (units of 2^-24) or zero.
        let exp = abs >> 23;
        if exp < 102 {
            // Below 2^-25, half the smallest subnormal (2^-25 itself ties to 0).
            return sign;
        }
        let mant = (abs & 0x7F_FFFF) | 0x80_0000;
        let shift = 126 - exp; // 14..=24
        let kept = mant >> shift;
        let rem = mant & ((1 << shift) - 1);
        let half = 1 << (shift - 1);
        let up = u32::from(rem > half || (rem == half && kept & 1 == 1));
        // A carry to 0x400 is the smallest normal, correctly encoded.
        sign | (kept + up) as u16
    }
}

/// Rounds f64 bits to IEEE binary16 bits, once (round to odd at f32 precision first: f32 has
/// more than f16's precision plus two bits, over all of f16's range). A NaN becomes
/// `sign | 0x7E00`.
#[inline(always)]
pub fn f16_from_f64(x: u64) -> u16 {
    f16_from_f32(f32_round_to_odd(x))
}

/// Rounds bf16 bits to IEEE binary16 bits: the bf16 value is exactly the f32 with those
/// bits on top, so this is the f32 rule (|x| >= 65520 overflows, NaN -> `sign | 0x7E00`).
#[inline(always)]
pub fn f16_from_bf16(b: u16) -> u16 {
    f16_from_f32(u32::from(b) << 16)
}

/// Widens f16 bits to the f32 bits of the same value (exact; a NaN stays a NaN).
#[inline(always)]
pub(crate) fn f32_from_f16(h: u16) -> u32 {
    let sign = u32::from(h & 0x8000) << 16;
    let abs = u32::from(h & 0x7FFF);
    let magnitude = if abs >= 0x7C00 {
        // Infinity or NaN: all-ones exponent, mantissa kept.
        (abs << 13) | 0x7F80_0000
    } else if abs >= 0x0400 {
        // Normal: rebias the exponent from 15 to 127.
        (abs << 13) + (112 << 23)
    } else {
        // Zero or subnormal, abs * 2^-24: both steps are exact and the result is zero or a
        // normal f32, so no MXCSR rounding or flush mode can change it (and it is cheaper
        // than renormalising by hand).
        (abs as f32 * (1.0 / 16_777_216.0)).to_bits()
    };
    sign | magnitude
}

/// Rounds f64 bits to f32 bits by truncation with the dropped bits ORed into the lsb
/// ("round to odd"), so that one later rounding to a format at least two bits narrower is the
/// correct rounding of the f64. Finite values >= 2^128 give the largest finite f32 (odd),
/// which every narrower format rounds to infinity; a NaN gives the quiet NaN of its sign.
/// Integer-only, so independent of the MXCSR rounding and flush modes.
#[inline(always)]
fn f32_round_to_odd(x: u64) -> u32 {
    let sign = (x >> 32) as u32 & 0x8000_0000;
    let abs = x & 0x7FFF_FFFF_FFFF_FFFF;
    let exp = (abs >> 52) as u32;
    let mant = abs & 0x000F_FFFF_FFFF_FFFF;
    let magnitude = if abs > 0x7FF0_0000_0000_0000 {
        0x7FC0_0000
    } else if abs == 0x7FF0_0000_0000_0000 {
        0x7F80_0000
    } else if exp >= 1151 {
        0x7F7F_FFFF
    } else if exp >= 897 {
        // Normal in f32: rebias from 1023 to 127 and keep 23 of the 52 mantissa bits.
        let sticky = u32::from(mant & 0x1FFF_FFFF != 0);
        ((exp - 896) << 23) | (mant >> 29) as u32 | sticky
    } else if exp == 0 {
        // f64 subnormals lie far below f32's smallest subnormal.
        u32::from(mant != 0)
    } else {
        // Subnormal in f32, in units of 2^-149.
        let full = mant | (1 << 52);
        let shift = 926 - exp; // >= 30
        if shift >= 64 {
            1
        } else {
            let sticky = u32::from(full & ((1 << shift) - 1) != 0);
            (full >> shift) as u32 | sticky
        }
    };
    sign | magnitude
}

/// F32 -> BF16 over little-endian bytes: `dst.len() == src.len() / 2`, any alignment.
pub fn f32_to_bf16(isa: Isa, src: &[u8], dst: &mut [u8]) {
    debug_assert_lengths(src, dst, 4);
    match isa.usable() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: usable() returns Avx512 only when the CPU has avx512f, avx512bw, avx2, f16c.
        Isa::Avx512 => unsafe { x86::f32_to_bf16_avx512(src, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: usable() returns Avx2 only when the CPU has avx2 and f16c.
        Isa::Avx2 => unsafe { x86::f32_to_bf16_avx2(src, dst) },
        _ => map_u32(src, dst, bf16_from_f32),
    }
}

/// F16 -> BF16 over little-endian bytes: `dst.len() == src.len()`, any alignment.
pub fn f16_to_bf16(isa: Isa, src: &[u8], dst: &mut [u8]) {
    debug_assert_lengths(src, dst, 2);
    match isa.usable() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: usable() returns Avx512 only when the CPU has avx512f, avx512bw, avx2, f16c.
        Isa::Avx512 => unsafe { x86::f16_to_bf16_avx512(src, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: usable() returns Avx2 only when the CPU has avx2 and f16c.
        Isa::Avx2 => unsafe { x86::f16_to_bf16_avx2(src, dst) },
        _ => map_u16(src, dst, bf16_from_f16),
    }
}

/// F64 -> BF16 over little-endian bytes: `dst.len() == src.len() / 4`, any alignment.
pub fn f64_to_bf16(isa: Isa, src: &[u8], dst: &mut [u8]) {
    debug_assert_lengths(src, dst, 8);
    match isa.usable() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: usable() returns Avx512 only when the CPU has avx512f, avx512bw, avx2, f16c.
        Isa::Avx512 => unsafe { x86::f64_to_bf16_avx512(src, dst) },
        // The round-to-odd step needs 64-bit variable shifts and lane masks; without AVX-512
        // the scalar loop is used (F64 checkpoints are rare).
        _ => map_u64(src, dst, bf16_from_f64),
    }
}

/// F32 -> F16 over little-endian bytes: `dst.len() == src.len() / 2`, any alignment.
pub fn f32_to_f16(isa: Isa, src: &[u8], dst: &mut [u8]) {
    debug_assert_lengths(src, dst, 4);
    match isa.usable() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: usable() returns Avx512 only when the CPU has avx512f, avx512bw, avx2, f16c.
        Isa::Avx512 => unsafe { x86::f32_to_f16_avx512(src, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: usable() returns Avx2 only when the CPU has avx2 and f16c.
        Isa::Avx2 => unsafe { x86::f32_to_f16_avx2(src, dst) },
        _ => map_u32(src, dst, f16_from_f32),
    }
}

/// F64 -> F16 over little-endian bytes: `dst.len() == src.len() / 4`, any alignment.
pub fn f64_to_f16(isa: Isa, src: &[u8], dst: &mut [u8]) {
    debug_assert_lengths(src, dst, 8);
    match isa.usable() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: usable() returns Avx512 only when the CPU has avx512f, avx512bw, avx2, f16c.
        Isa::Avx512 => unsafe { x86::f64_to_f16_avx512(src, dst) },
        // Scalar without AVX-512, as in f64_to_bf16.
        _ => map_u64(src, dst, f16_from_f64),
    }
}

/// BF16 -> F16 over little-endian bytes: `dst.len() == src.len()`, any alignment.
///
/// Each block is widened exactly to F32 on the stack and rounded by `f32_to_f16`, so it
/// takes that kernel's SIMD path and its rounding, unchanged.
pub fn bf16_to_f16(isa: Isa, src: &[u8], dst: &mut [u8]) {
    debug_assert_lengths(src, dst, 2);
    const BLOCK: usize = 1024;
    let mut wide = [0u8; BLOCK * 4];
    for (s, d) in src.chunks(BLOCK * 2).zip(dst.chunks_mut(BLOCK * 2)) {
        // Mismatched lengths stop at the shorter side, as in the other kernels.
        let n = (s.len() / 2).min(d.len() / 2);
        let (s, wide_n) = (s.as_chunks::<2>().0, wide.as_chunks_mut::<4>().0);
        for (b, w) in s.iter().zip(wide_n.iter_mut()).take(n) {
            *w = (u32::from(u16::from_le_bytes(*b)) << 16).to_le_bytes();
        }
        f32_to_f16(isa, &wide[..n * 4], &mut d[..n * 2]);
    }
}

fn debug_assert_lengths(src: &[u8], dst: &[u8], src_elem: usize) {
    debug_assert!(
        src.len().is_multiple_of(src_elem) && dst.len() == src.len() / src_elem * 2,
        "kernel lengths: src {} bytes of {src_elem}-byte elements, dst {} bytes",
        src.len(),
        dst.len()
    );
}

// The scalar loops are written so that LLVM vectorises them for the baseline target; the SIMD
// paths also use them for their tails. With mismatched lengths they stop at the shorter side.

#[inline(always)]
fn map_u16(src: &[u8], dst: &mut [u8], convert: impl Fn(u16) -> u16) {
    let (src, dst) = (src.as_chunks::<2>().0, dst.as_chunks_mut::<2>().0);
    for (s, d) in src.iter().zip(dst) {
        *d = convert(u16::from_le_bytes(*s)).to_le_bytes();
    }
}

#[inline(always)]
fn map_u32(src: &[u8], dst: &mut [u8], convert: impl Fn(u32) -> u16) {
    let (src, dst) = (src.as_chunks::<4>().0, dst.as_chunks_mut::<2>().0);
    for (s, d) in src.iter().zip(dst) {
        *d = convert(u32::from_le_bytes(*s)).to_le_bytes();
    }
}

#[inline(always)]
fn map_u64(src: &[u8], dst: &mut [u8], convert: impl Fn(u64) -> u16) {
    let (src, dst) = (src.as_chunks::<8>().0, dst.as_chunks_mut::<2>().0);
    for (s, d) in src.iter().zip(dst) {
        *d = convert(u64::from_le_bytes(*s)).to_le_bytes();
    }
}

/// The AVX2 and AVX-512 loops. Each handles whole vectors with unaligned loads and stores
/// and leaves the tail to the scalar loop.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{map_u16, map_u32, map_u64};
    use std::arch::x86_64::*;

    /// Elements convertible from `src` into `dst` (the shorter side wins).
    fn count(src: &[u8], src_elem: usize, dst: &[u8]) -> usize {
        (src.len() / src_elem).min(dst.len() / 2)
    }

    /// bf16 bits of eight f32 lanes, in the low half of each 32-bit lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn bf16_lanes_avx2(v: __m256i) -> __m256i {
        let high = _mm256_srli_epi32::<16>(v);
        let lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
        let biased = _mm256_add_epi32(v, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
        let rounded = _mm256_srli_epi32::<16>(biased);
        let abs = _mm256_and_si256(v, _mm256_set1_epi32(0x7FFF_FFFF));
        let is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F80_0000));
        let sign = _mm256_and_si256(high, _mm256_set1_epi32(0x8000));
        let quiet = _mm256_or_si256(sign, _mm256_set1_epi32(0x7FC0));
        _mm256_blendv_epi8(rounded, quiet, is_nan)
    }

    /// Packs the low halves of the 32-bit lanes of `a` then `b`, in order.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn pack_low_halves_avx2(a: __m256i, b: __m256i) -> __m256i {
        // packus works per 128-bit lane; the values fit in 16 bits, so it only reorders.
        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b))
    }

    /// bf16 bits of sixteen f32 lanes, in the low half of each 32-bit lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn bf16_lanes_avx512(v: __m512i) -> __m512i {
        let high = _mm512_srli_epi32::<16>(v);
        let lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
        let biased = _mm512_add_epi32(v, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
        let abs = _mm512_and_si512(v, _mm512_set1_epi32(0x7FFF_FFFF));
        let is_number = _mm512_cmple_epi32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
        let sign = _mm512_and_si512(high, _mm512_set1_epi32(0x8000));
        let quiet = _mm512_or_si512(sign, _mm512_set1_epi32(0x7FC0));
        // The shift of the numbers merged over the quiet NaNs, in one instruction.
        _mm512_mask_srli_epi32::<16>(quiet, is_number, biased)
    }

    /// Packs the low halves of the 32-bit lanes of `a` then `b`, in order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn pack_low_halves_avx512(a: __m512i, b: __m512i) -> __m512i {
        let packed = _mm512_packus_epi32(a, b);
        _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), packed)
    }

    /// f32 lanes with every NaN replaced by the canonical quiet NaN of its sign, whose f16
    /// conversion is exactly `sign | 0x7E00` (vcvtps2ph would keep payload bits).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn quiet_nans_avx2(v: __m256i) -> __m256i {
        let abs = _mm256_and_si256(v, _mm256_set1_epi32(0x7FFF_FFFF));
        let is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F80_0000));
        let sign = _mm256_and_si256(v, _mm256_set1_epi32(i32::MIN));
        let quiet = _mm256_or_si256(sign, _mm256_set1_epi32(0x7FC0_0000));
        _mm256_blendv_epi8(v, quiet, is_nan)
    }

    /// As quiet_nans_avx2, for sixteen lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn quiet_nans_avx512(v: __m512i) -> __m512i {
        let abs = _mm512_and_si512(v, _mm512_set1_epi32(0x7FFF_FFFF));
        let is_nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
        let sign = _mm512_and_si512(v, _mm512_set1_epi32(i32::MIN));
        let quiet = _mm512_or_si512(sign, _mm512_set1_epi32(0x7FC0_0000));
        _mm512_mask_blend_epi32(is_nan, v, quiet)
    }

    /// # Safety
    /// The CPU must support avx2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn f32_to_bf16_avx2(src: &[u8], dst: &mut [u8]) {
        let n = count(src, 4, dst);
        let body = n - n % 16;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..body).step_by(16) {
            // SAFETY: i + 16 <= n, so bytes 4i..4i+64 of src and 2i..2i+32 of dst are in
            // bounds; loadu/storeu accept any alignment.
            unsafe {
                let a = _mm256_loadu_si256(s.add(4 * i).cast());
                let b = _mm256_loadu_si256(s.add(4 * i + 32).cast());
                let out = pack_low_halves_avx2(bf16_lanes_avx2(a), bf16_lanes_avx2(b));
                _mm256_storeu_si256(d.add(2 * i).cast(), out);
            }
        }
        map_u32(&src[4 * body..], &mut dst[2 * body..], super::bf16_from_f32);
    }

    /// # Safety
    /// The CPU must support avx512f and avx512bw.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn f32_to_bf16_avx512(src: &[u8], dst: &mut [u8]) {
        let n = count(src, 4, dst);
        let body = n - n % 32;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..body).step_by(32) {
            // SAFETY: i + 32 <= n, so bytes 4i..4i+128 of src and 2i..2i+64 of dst are in
            // bounds; loadu/storeu accept any alignment.
            unsafe {
                let a = _mm512_loadu_si512(s.add(4 * i).cast());
                let b = _mm512_loadu_si512(s.add(4 * i + 64).cast());
                let out = pack_low_halves_avx512(bf16_lanes_avx512(a), bf16_lanes_avx512(b));
                _mm512_storeu_si512(d.add(2 * i).cast(), out);
            }
        }
        map_u32(&src[4 * body..], &mut dst[2 * body..], super::bf16_from_f32);
    }

    /// # Safety
    /// The CPU must support avx2 and f16c.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_to_bf16_avx2(src: &[u8], dst: &mut [u8]) {
        let n = count(src, 2, dst);
        let body = n - n % 16;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..body).step_by(16) {
            // SAFETY: i + 16 <= n, so bytes 2i..2i+32 of src and of dst are in bounds;
            // loadu/storeu accept any alignment.
            unsafe {
                let a = _mm_loadu_si128(s.add(2 * i).cast());
                let b = _mm_loadu_si128(s.add(2 * i + 16).cast());
                // vcvtph2ps is exact (subnormal halves become normal floats) and ignores DAZ.
                let a = _mm256_castps_si256(_mm256_cvtph_ps(a));
                let b = _mm256_castps_si256(_mm256_cvtph_ps(b));
                let out = pack_low_halves_avx2(bf16_lanes_avx2(a), bf16_lanes_avx2(b));
                _mm256_storeu_si256(d.add(2 * i).cast(), out);
            }
        }
        map_u16(&src[2 * body..], &mut dst[2 * body..], super::bf16_from_f16);
    }

    /// # Safety
    /// The CPU must support avx512f and avx512bw.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn f16_to_bf16_avx512(src: &[u8], dst: &mut [u8]) {
        let n = count(src, 2, dst);
        let body = n - n % 32;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..body).step_by(32) {
            // SAFETY: i + 32 <= n, so bytes 2i..2i+64 of src and of dst are in bounds;
            // loadu/storeu accept any alignment.
            unsafe {
                let a = _mm256_loadu_si256(s.add(2 * i).cast());
                let b = _mm256_loadu_si256(s.add(2 * i + 32).cast());
                // vcvtph2ps is exact (subnormal halves become normal floats) and ignores DAZ.
                let a = _mm512_castps_si512(_mm512_cvtph_ps(a));
                let b = _mm512_castps_si512(_mm512_cvtph_ps(b));
                let out = pack_low_halves_avx512(bf16_lanes_avx512(a), bf16_lanes_avx512(b));
                _mm512_storeu_si512(d.add(2 * i).cast(), out);
            }
        }
        map_u16(&src[2 * body..], &mut dst[2 * body..], super::bf16_from_f16);
    }

    /// # Safety
    /// The CPU must support avx2 and f16c.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f32_to_f16_avx2(src: &[u8], dst: &mut [u8]) {
        let n = count(src, 4, dst);
        let body = n - n % 8;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..body).step_by(8) {
            // SAFETY: i + 8 <= n, so bytes 4i..4i+32 of src and 2i..2i+16 of dst are in
            // bounds; loadu/storeu accept any alignment.
            unsafe {
                let v = quiet_nans_avx2(_mm256_loadu_si256(s.add(4 * i).cast()));
                // Rounding from the immediate (nearest, ties to even); vcvtps2ph produces
                // subnormal halves regardless of FTZ.
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_castsi256_ps(v));
                _mm_storeu_si128(d.add(2 * i).cast(), h);
            }
        }
        map_u32(&src[4 * body..], &mut dst[2 * body..], super::f16_from_f32);
    }

    /// # Safety
    /// The CPU must support avx512f.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn f32_to_f16_avx512(src: &[u8], dst: &mut [u8]) {
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let n = count(src, 4, dst);
        let body = n - n % 16;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..body).step_by(16) {
            // SAFETY: i + 16 <= n, so bytes 4i..4i+64 of src and 2i..2i+32 of dst are in
            // bounds; loadu/storeu accept any alignment.
            unsafe {
                let v = quiet_nans_avx512(_mm512_loadu_si512(s.add(4 * i).cast()));
                let h = _mm512_cvtps_ph::<NEAREST>(_mm512_castsi512_ps(v));
                _mm256_storeu_si256(d.add(2 * i).cast(), h);
            }
        }
        map_u32(&src[4 * body..], &mut dst[2 * body..], super::f16_from_f32);
    }

    /// f32_round_to_odd (see there) on eight f64 lanes, result in each 64-bit lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn f32_round_to_odd_avx512(x: __m512i) -> __m512i {
        let set = _mm512_set1_epi64;
        let abs = _mm512_and_si512(x, set(0x7FFF_FFFF_FFFF_FFFF));
        let sign = _mm512_and_si512(_mm512_srli_epi64::<32>(x), set(0x8000_0000));
        let exp = _mm512_srli_epi64::<52>(abs);
        let mant = _mm512_and_si512(abs, set(0x000F_FFFF_FFFF_FFFF));
        let zero = _mm512_setzero_si512();
        let one = set(1);

        // Normal in f32.
        let sticky =
            _mm512_mask_blend_epi64(_mm512_test_epi64_mask(mant, set(0x1FFF_FFFF)), zero, one);
        let rebiased = _mm512_slli_epi64::<23>(_mm512_sub_epi64(exp, set(896)));
        let normal = _mm512_or_si512(
            _mm512_or_si512(rebiased, _mm512_srli_epi64::<29>(mant)),
            sticky,
        );

        // Subnormal in f32 (or f64 subnormal / zero): shift counts of 64 or more give 0.
        let is_f64_normal = _mm512_cmpneq_epi64_mask(exp, zero);
        let full = _mm512_mask_or_epi64(mant, is_f64_normal, mant, set(1 << 52));
        let shift = _mm512_sub_epi64(set(926), exp);
        let kept = _mm512_srlv_epi64(full, shift);
        let lost = _mm512_cmpneq_epi64_mask(_mm512_sllv_epi64(kept, shift), full);
        let tiny = _mm512_mask_or_epi64(kept, lost, kept, one);

        let is_normal = _mm512_cmpge_epi64_mask(exp, set(897));
        let mut magnitude = _mm512_mask_blend_epi64(is_normal, tiny, normal);
        let is_big = _mm512_cmpge_epi64_mask(exp, set(1151));
        magnitude = _mm512_mask_blend_epi64(is_big, magnitude, set(0x7F7F_FFFF));
        let inf = set(0x7FF0_0000_0000_0000);
        let is_inf = _mm512_cmpeq_epi64_mask(abs, inf);
        magnitude = _mm512_mask_blend_epi64(is_inf, magnitude, set(0x7F80_0000));
        let is_nan = _mm512_cmpgt_epi64_mask(abs, inf);
        magnitude = _mm512_mask_blend_epi64(is_nan, magnitude, set(0x7FC0_0000));
        _mm512_or_si512(sign, magnitude)
    }

    /// # Safety
    /// The CPU must support avx512f and avx512bw.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn f64_to_bf16_avx512(src: &[u8], dst: &mut [u8]) {
        let n = count(src, 8, dst);
        let body = n - n % 16;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..body).step_by(16) {
            // SAFETY: i + 16 <= n, so bytes 8i..8i+128 of src and 2i..2i+32 of dst are in
            // bounds; loadu/storeu accept any alignment.
            unsafe {
                let a = f32_round_to_odd_avx512(_mm512_loadu_si512(s.add(8 * i).cast()));
                let b = f32_round_to_odd_avx512(_mm512_loadu_si512(s.add(8 * i + 64).cast()));
                let a = _mm512_castsi256_si512(_mm512_cvtepi64_epi32(a));
                let f = _mm512_inserti64x4::<1>(a, _mm512_cvtepi64_epi32(b));
                let out = _mm512_cvtepi32_epi16(bf16_lanes_avx512(f));
                _mm256_storeu_si256(d.add(2 * i).cast(), out);
            }
        }
        map_u64(&src[8 * body..], &mut dst[2 * body..], super::bf16_from_f64);
    }

    /// # Safety
    /// The CPU must support avx512f and avx512bw.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn f64_to_f16_avx512(src: &[u8], dst: &mut [u8]) {
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let n = count(src, 8, dst);
        let body = n - n % 16;
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (0..body).step_by(16) {
            // SAFETY: i + 16 <= n, so bytes 8i..8i+128 of src and 2i..2i+32 of dst are in
            // bounds; loadu/storeu accept any alignment.
            unsafe {
                let a = f32_round_to_odd_avx512(_mm512_loadu_si512(s.add(8 * i).cast()));
                let b = f32_round_to_odd_avx512(_mm512_loadu_si512(s.add(8 * i + 64).cast()));
                let a = _mm512_castsi256_si512(_mm512_cvtepi64_epi32(a));
                let f = _mm512_inserti64x4::<1>(a, _mm512_cvtepi64_epi32(b));
                // The only NaNs left are canonical quiet ones, which convert to sign | 0x7E00.
                let h = _mm512_cvtps_ph::<NEAREST>(_mm512_castsi512_ps(f));
                _mm256_storeu_si256(d.add(2 * i).cast(), h);
            }
        }
        map_u64(&src[8 * body..], &mut dst[2 * body..], super::f16_from_f64);
    }
}

#[cfg(test)]
mod tests {
    //! Every kernel, for every ISA this CPU has, against references written independently of
    //! the kernels: exact f64 arithmetic on the target format's grid, not bit tricks.
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    type Kernel = fn(Isa, &[u8], &mut [u8]);

    const VECTORS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/bf16-vectors.json");

    // ---- independent references --------------------------------------------------------

    fn pow2(e: i32) -> f64 {
        assert!((-1022..=1023).contains(&e));
        f64::from_bits(((e + 1023) as u64) << 52)
    }

    /// floor(log2 y) for finite y > 0; for f64 subnormals something below -1022 (callers clamp).
    fn floor_log2(y: f64) -> i32 {
        (y.to_bits() >> 52) as i32 - 1023
    }

    /// The nearest value to finite `y >= 0` (ties to even) on the grid of a format with `digits`
    /// significant bits and smallest normal 2^min_exp, with no upper exponent bound.
    fn round_on_grid(y: f64, digits: i32, min_exp: i32) -> f64 {
        if y == 0.0 {
            return 0.0;
        }
        let exp = floor_log2(y).max(min_exp) - (digits - 1);
        // Exact: scaling by a power of two that stays within f64's normal range; the
        // result is below 2^digits, so its integer part converts exactly.
        let scaled = y * pow2(-exp);
        let below = scaled as u64;
        let fraction = scaled - below as f64;
        let n = if fraction < 0.5 || (fraction == 0.5 && below.is_multiple_of(2)) {
            below
        } else {
            below + 1
        };
        n as f64 * pow2(exp)
    }

    fn sign_bit(x: f64) -> u16 {
        if x.is_sign_negative() {
            0x8000
        } else {
            0
        }
    }

    /// bf16 bits of the value `x` rounded once.
    fn bf16_of_value(x: f64) -> u16 {
        let sign = sign_bit(x);
        if x.is_nan() {
            return sign | 0x7FC0;
        }
        if x.is_infinite() {
            return sign | 0x7F80;
        }
        let r = round_on_grid(x.abs(), 8, -126);
        if r >= pow2(128) {
            return sign | 0x7F80;
        }
        // r lies on the bf16 grid, so the f32 holding it exactly has 16 zero low bits.
        let bits = (r as f32).to_bits();
        assert_eq!(bits & 0xFFFF, 0, "{r:e} is not a bf16 value");
        sign | (bits >> 16) as u16
    }

    /// f16 bits of the value `x` rounded once.
    fn f16_of_value(x: f64) -> u16 {
        let sign = sign_bit(x);
        if x.is_nan() {
            return sign | 0x7E00;
        }
        if x.is_infinite() {
            return sign | 0x7C00;
        }
        let r = round_on_grid(x.abs(), 11, -14);
        if r >= 65536.0 {
            sign | 0x7C00
        } else if r < pow2(-14) {
            sign | (r * pow2(24)) as u16
        } else {
            let e = floor_log2(r);
            let fraction = (r * pow2(-e) - 1.0) * 1024.0;
            sign | (((e + 15) as u16) << 10) | fraction as u16
        }
    }

    /// The value of f16 bits, by arithmetic.
    fn f16_value(h: u16) -> f64 {
        let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
        let exp = i32::from((h >> 10) & 0x1F);
        let mant = f64::from(h & 0x3FF);
        match exp {
            0 => sign * mant * pow2(-24),
            0x1F if mant == 0.0 => sign * f64::INFINITY,
            0x1F => f64::NAN.copysign(sign),
            _ => sign * (1024.0 + mant) * pow2(exp - 25),
        }
    }

    /// bf16 from f32 by keeping the high half and looking at the low half (written without
    /// early returns so that the exhaustive sweep vectorises it).
    fn bf16_by_halves(u: u32) -> u16 {
        let keep = (u >> 16) as u16;
        let rem = u & 0xFFFF;
        let up = rem > 0x8000 || (rem == 0x8000 && keep & 1 == 1);
        let rounded = keep.wrapping_add(u16::from(up));
        let quiet = (keep & 0x8000) | 0x7FC0;
        if f32::from_bits(u).is_nan() {
            quiet
        } else {
            rounded
        }
    }

    /// f16 from f32 through its exact f64 value. Values far outside f16's range (clear of
    /// every rounding boundary) take a shortcut, which makes the exhaustive sweep affordable.
    fn f16_by_value(u: u32) -> u16 {
        let x = f64::from(f32::from_bits(u));
        let magnitude = x.abs();
        if magnitude >= 131072.0 {
            sign_bit(x) | 0x7C00
        } else if magnitude < pow2(-26) {
            sign_bit(x)
        } else {
            f16_of_value(x)
        }
    }

    // ---- harness ------------------------------------------------------------------------

    fn to_bytes(inputs: &[u64], size: usize, offset: usize) -> Vec<u8> {
        let mut bytes = vec![0xA5; offset];
        for x in inputs {
            bytes.extend_from_slice(&x.to_le_bytes()[..size]);
        }
        bytes
    }

    fn to_u16s(bytes: &[u8]) -> Vec<u16> {
        bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    /// Runs `kernel` for every ISA on `inputs` (elements of `size` bytes) with source and
    /// destination at offsets 0 and 1 of their buffers (unaligned); with `tails`, over every
    /// prefix length too, so that each element is also met in every tail position.
    fn check_slices(
        name: &str,
        kernel: Kernel,
        size: usize,
        inputs: &[u64],
        expected: &[u16],
        tails: bool,
    ) {
        assert_eq!(inputs.len(), expected.len());
        let lengths: Vec<usize> = if tails {
            (0..=inputs.len()).collect()
        } else {
            vec![inputs.len()]
        };
        // Offsets (0, 0) and (1, 1) for long inputs; all four pairs with tails.
        let offsets: &[(usize, usize)] = if tails {
            &[(0, 0), (0, 1), (1, 0), (1, 1)]
        } else {
            &[(0, 0), (1, 1)]
        };
        for isa in Isa::available() {
            for &(src_offset, dst_offset) in offsets {
                let src = to_bytes(inputs, size, src_offset);
                let mut dst = vec![0x5A; dst_offset + 2 * inputs.len()];
                for &n in &lengths {
                    let src = &src[src_offset..src_offset + n * size];
                    let out = &mut dst[dst_offset..dst_offset + 2 * n];
                    kernel(isa, src, out);
                    let got = to_u16s(out);
                    if let Some(i) = (0..n).find(|&i| got[i] != expected[i]) {
                        panic!(
                            "{name} {isa:?} (src+{src_offset}, dst+{dst_offset}, len {n}): \
                             element {i}, input {:#x}: got {:#06x}, want {:#06x}",
                            inputs[i], got[i], expected[i]
                        );
                    }
                }
            }
        }
    }

    /// Repeats `items` cyclically to at least `len` elements (vectors longer than any SIMD
    /// block, so the tables also run through the vector bodies).
    fn cycled<T: Copy>(items: &[T], len: usize) -> Vec<T> {
        items
            .iter()
            .copied()
            .cycle()
            .take(len.max(items.len()))
            .collect()
    }

    /// Checks `kernel`, for every ISA, on all 2^32 f32 patterns against `reference`, in
    /// cache-sized batches on every thread.
    fn sweep_all_f32(name: &str, kernel: Kernel, reference: impl Fn(u32) -> u16 + Sync) {
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
                        let start = start as u32;
                        let pairs = src.as_chunks_mut::<4>().0.iter_mut();
                        let pairs = pairs.zip(want.as_chunks_mut::<2>().0);
                        for (i, (s, w)) in (0..BATCH as u32).zip(pairs) {
                            let u = start.wrapping_add(i);
                            *s = u.to_le_bytes();
                            *w = reference(u).to_le_bytes();
                        }
                        for &isa in &isas {
                            kernel(isa, &src, &mut got);
                            if got != want {
                                let (got, want) = (to_u16s(&got), to_u16s(&want));
                                let i = (0..BATCH).find(|&i| got[i] != want[i]).unwrap();
                                panic!(
                                    "{name} {isa:?}: input {:#010x}: got {:#06x}, want {:#06x}",
                                    start as usize + i,
                                    got[i],
                                    want[i]
                                );
                            }
                        }
                    }
                });
            }
        });
    }

    use crate::testutil::Rng;

    const SEED: u64 = 0x5EED_0BF1_6C0D_E5ED;

    /// f64 inputs aimed at rounding decisions of a narrow format: the exact midpoints between
    /// neighbours `value(b)` and `value(b + 1)` (b random below `top`), the f64s next to
    /// them, points off them by about a quarter, half and one f32 ulp (where rounding to f32
    /// first would land on the midpoint), and deeper; then uniformly random bits, and random
    /// values with exponents around the format's range. About 2 million cases in debug
    /// builds, four times as many in release builds.
    fn f64_cases(rng: &mut Rng, value: fn(u16) -> f64, top: u16, overflow: f64) -> Vec<u64> {
        let scale = if cfg!(debug_assertions) { 1 } else { 4 };
        let mut cases = Vec::new();
        for _ in 0..75_000 * scale {
            let b = rng.below(u64::from(top) + 1) as u16;
            let lo = value(b);
            let hi = if b == top { overflow } else { value(b + 1) };
            let mid = (lo + hi) / 2.0;
            let sign = rng.next() & (1 << 63);
            let bits = mid.to_bits();
            let mut push = |x: f64| cases.push(x.to_bits() | sign);
            push(mid);
            push(f64::from_bits(bits + 1));
            push(f64::from_bits(bits - 1));
            for shift in [25, 26, 24, 40, 30 + rng.below(23) as i32] {
                let off = mid * pow2(-shift);
                push(mid + off);
                push(mid - off);
            }
            push(lo + (hi - lo) * (rng.below(1 << 20) as f64) * pow2(-20));
        }
        for _ in 0..500_000 * scale {
            cases.push(rng.next());
        }
        for _ in 0..500_000 * scale {
            let exp = 1023 - 160 + rng.below(300);
            cases.push((rng.next() & (1 << 63)) | (exp << 52) | (rng.next() >> 12));
        }
        cases
    }

    fn bf16_value(b: u16) -> f64 {
        f64::from(f32::from_bits(u32::from(b) << 16))
    }

    // ---- tests --------------------------------------------------------------------------

    #[test]
    fn isa_detection_is_consistent() {
        let available = Isa::available();
        assert_eq!(available[0], Isa::Scalar);
        assert_eq!(*available.last().unwrap(), Isa::detect());
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
            assert_eq!(isa.usable() == isa, available.contains(&isa), "{isa:?}");
        }
        let names: Vec<_> = [Isa::Scalar, Isa::Avx2, Isa::Avx512].map(Isa::name).into();
        assert_eq!(names, ["scalar", "avx2", "avx512"]);
        println!("available: {available:?}");
    }

    #[test]
    fn reference_vectors_match() {
        let text = std::fs::read_to_string(VECTORS).expect("read bf16-vectors.json");
        let doc: serde_json::Value = serde_json::from_str(&text).expect("parse bf16-vectors.json");
        let (mut f32s, mut f16s, mut f64s) = (Vec::new(), Vec::new(), Vec::new());
        for v in doc["vectors"].as_array().expect("vectors array") {
            let field = |key: &str| v[key].as_str().unwrap_or_else(|| panic!("{key} in {v}"));
            let input = u64::from_str_radix(field("input"), 16).expect("hex input");
            let want = u16::from_str_radix(field("bf16"), 16).expect("hex bf16");
            let (got, independent, group) = match field("from") {
                "F32" => {
                    let u = input as u32;
                    let by_value = bf16_of_value(f64::from(f32::from_bits(u)));
                    assert_eq!(by_value, bf16_by_halves(u), "references disagree on {u:#x}");
                    (bf16_from_f32(u), by_value, &mut f32s)
                }
                "F16" => {
                    let h = input as u16;
                    (bf16_from_f16(h), bf16_of_value(f16_value(h)), &mut f16s)
                }
                "F64" => (
                    bf16_from_f64(input),
                    bf16_of_value(f64::from_bits(input)),
                    &mut f64s,
                ),
                other => panic!("unknown source dtype {other}"),
            };
            let why = field("why");
            assert_eq!(got, want, "{} {input:#x} ({why})", field("from"));
            assert_eq!(independent, want, "reference on {input:#x} ({why})");
            group.push((input, want));
        }
        assert!(!f32s.is_empty() && !f16s.is_empty() && !f64s.is_empty());
        for (name, kernel, size, group) in [
            ("f32_to_bf16", f32_to_bf16 as Kernel, 4, &f32s),
            ("f16_to_bf16", f16_to_bf16, 2, &f16s),
            ("f64_to_bf16", f64_to_bf16, 8, &f64s),
        ] {
            let group = cycled(group, 100);
            let inputs: Vec<u64> = group.iter().map(|p| p.0).collect();
            let expected: Vec<u16> = group.iter().map(|p| p.1).collect();
            check_slices(name, kernel, size, &inputs, &expected, true);
        }
    }

    #[test]
    fn f32_to_bf16_edges() {
        let table: &[(u32, u16)] = &[
            (0x0000_0000, 0x0000),
            (0x8000_0000, 0x8000),
            (0x3F80_8000, 0x3F80), // tie, even kept part stays
            (0x3F81_8000, 0x3F82), // tie, odd kept part rounds up
            (0xBF81_8000, 0xBF82),
            (0x3F80_8001, 0x3F81), // sticky above the tie
            (0x3F80_7FFF, 0x3F80),
            (0x3FFF_8000, 0x4000), // carry into the exponent
            (0x7F7F_7FFF, 0x7F7F), // largest below the overflow midpoint
            (0x7F7F_8000, 0x7F80), // overflow midpoint ties to infinity
            (0xFF7F_FFFF, 0xFF80), // FLT_MAX overflows
            (0x7F80_0000, 0x7F80), // inf
            (0xFF80_0000, 0xFF80), // -inf
            (0x0000_0001, 0x0000), // smallest subnormal rounds to zero
            (0x0000_8000, 0x0000), // subnormal tie, even
            (0x0001_8000, 0x0002), // subnormal tie, odd
            (0x0000_8001, 0x0001), // subnormal kept, not flushed
            (0x8001_0000, 0x8001), // negative subnormal exact
            (0x007F_FFFF, 0x0080), // largest subnormal rounds to smallest normal
            (0x7FC0_0000, 0x7FC0), // qNaN
            (0xFFC0_0001, 0xFFC0), // -qNaN with low payload
            (0x7F80_0001, 0x7FC0), // sNaN, payload only in the low half
            (0xFF80_FFFF, 0xFFC0), // -sNaN, payload only in the low half
            (0x7FBF_FFFF, 0x7FC0), // sNaN that would round into qNaN space
            (0x7FFF_FFFF, 0x7FC0), // NaN that would wrap past 0x7FFF
            (0xFFFF_FFFF, 0xFFC0), // NaN that would wrap the u32
        ];
        let mut inputs: Vec<u64> = table.iter().map(|p| u64::from(p.0)).collect();
        let mut expected: Vec<u16> = table.iter().map(|p| p.1).collect();
        for &(u, want) in table {
            assert_eq!(bf16_from_f32(u), want, "{u:#x}");
            assert_eq!(bf16_by_halves(u), want, "reference on {u:#x}");
        }
        check_slices(
            "f32_to_bf16",
            f32_to_bf16,
            4,
            &cycled(&inputs, 100),
            &cycled(&expected, 100),
            true,
        );

        // NaN payloads: truncation would give inf in the first range and wrap in the second.
        for u in (0x7F80_0001..=0x7F80_FFFF_u32).chain(0xFFFF_8001..=0xFFFF_FFFF) {
            inputs.push(u64::from(u));
            expected.push(((u >> 16) as u16 & 0x8000) | 0x7FC0);
        }
        check_slices(
            "f32_to_bf16 NaN payloads",
            f32_to_bf16,
            4,
            &inputs,
            &expected,
            false,
        );
    }

    #[test]
    fn f32_to_bf16_sampled_against_reference() {
        // Every high half with the low halves that decide rounding (the debug-build stand-in
        // for the exhaustive sweep).
        let lows = [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000, 0x1234];
        let inputs: Vec<u64> = (0..=0xFFFF_u64)
            .flat_map(|hi| lows.iter().map(move |&lo| hi << 16 | lo))
            .collect();
        let expected: Vec<u16> = inputs.iter().map(|&u| bf16_by_halves(u as u32)).collect();
        check_slices("f32_to_bf16", f32_to_bf16, 4, &inputs, &expected, false);
    }

    #[test]
    fn f16_to_bf16_all_halves() {
        let inputs: Vec<u64> = (0..=0xFFFF).collect();
        let expected: Vec<u16> = (0..=0xFFFF).map(bf16_from_f16).collect();
        for h in 0..=0xFFFF {
            let want = bf16_of_value(f16_value(h));
            assert_eq!(bf16_from_f16(h), want, "{h:#06x}");
        }
        check_slices("f16_to_bf16", f16_to_bf16, 2, &inputs, &expected, false);
        let tail = cycled(&inputs[0x3C00..0x3C40], 100);
        let tail_expected: Vec<u16> = tail.iter().map(|&h| bf16_from_f16(h as u16)).collect();
        check_slices(
            "f16_to_bf16 tails",
            f16_to_bf16,
            2,
            &tail,
            &tail_expected,
            true,
        );
    }

    #[test]
    fn f32_to_f16_edges() {
        let table: &[(u32, u16)] = &[
            (0x0000_0000, 0x0000),
            (0x8000_0000, 0x8000),
            (0x3F80_0000, 0x3C00), // 1.0
            (0x3F80_1000, 0x3C00), // tie, even
            (0x3F80_3000, 0x3C02), // tie, odd
            (0x3F80_1001, 0x3C01), // sticky
            (0x477F_E000, 0x7BFF), // 65504
            (0x477F_EFFF, 0x7BFF), // just below 65520
            (0x477F_F000, 0x7C00), // 65520 ties up to inf
            (0xC77F_F000, 0xFC00),
            (0x7F7F_FFFF, 0x7C00), // FLT_MAX
            (0x7F80_0000, 0x7C00), // inf
            (0x3880_0000, 0x0400), // 2^-14, smallest normal
            (0x387F_F000, 0x0400), // rounds up into the normals
            (0x3380_0000, 0x0001), // 2^-24, smallest subnormal
            (0x3300_0000, 0x0000), // 2^-25, tie to even zero
            (0x3300_0001, 0x0001), // just above
            (0x33C0_0000, 0x0002), // 1.5 * 2^-24, tie to even 2
            (0x3420_0000, 0x0002), // 2.5 * 2^-24, tie to even 2
            (0xB460_0000, 0x8004), // -3.5 * 2^-24, tie to even 4
            (0x0000_0001, 0x0000), // f32 subnormal
            (0x8000_0001, 0x8000),
            (0x7FC0_0000, 0x7E00), // qNaN
            (0xFF80_0001, 0xFE00), // -sNaN, low payload
            (0x7FFF_FFFF, 0x7E00),
            (0x7F80_1FFF, 0x7E00), // payload below the f16 mantissa
        ];
        for &(u, want) in table {
            assert_eq!(f16_from_f32(u), want, "{u:#x}");
            assert_eq!(f16_by_value(u), want, "reference on {u:#x}");
        }
        let inputs: Vec<u64> = table.iter().map(|p| u64::from(p.0)).collect();
        let expected: Vec<u16> = table.iter().map(|p| p.1).collect();
        check_slices(
            "f32_to_f16",
            f32_to_f16,
            4,
            &cycled(&inputs, 100),
            &cycled(&expected, 100),
            true,
        );
    }

    #[test]
    fn f32_to_f16_sampled_against_reference() {
        // Every high half with low halves around f16 ties (bit 12 for normals).
        let lows = [
            0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x7FFF, 0x8000, 0xFFFF,
        ];
        let inputs: Vec<u64> = (0..=0xFFFF_u64)
            .flat_map(|hi| lows.iter().map(move |&lo| hi << 16 | lo))
            .collect();
        let expected: Vec<u16> = inputs.iter().map(|&u| f16_by_value(u as u32)).collect();
        check_slices("f32_to_f16", f32_to_f16, 4, &inputs, &expected, false);
    }

    #[test]
    fn bf16_to_f16_all_bf16s() {
        // Every bf16 pattern against the exact-value reference (f32 widening is exact),
        // and the slice kernel against the scalar rule, across blocks and tails.
        let inputs: Vec<u64> = (0..=0xFFFF).collect();
        let expected: Vec<u16> = (0..=0xFFFF_u16).map(f16_from_bf16).collect();
        for b in 0..=0xFFFF_u16 {
            let want = f16_by_value(u32::from(b) << 16);
            assert_eq!(f16_from_bf16(b), want, "{b:#06x}");
            assert_eq!(
                f16_from_bf16(b),
                f16_from_f32(u32::from(b) << 16),
                "{b:#06x}"
            );
        }
        check_slices("bf16_to_f16", bf16_to_f16, 2, &inputs, &expected, false);
        let table: &[(u16, u16)] = &[
            (0x477F, 0x7BF8), // 65280
            (0x4780, 0x7C00), // 65536 overflows
            (0xC780, 0xFC00),
            (0x3380, 0x0001), // 2^-24
            (0x3300, 0x0000), // 2^-25 ties to zero
            (0x7FC1, 0x7E00), // NaN, payload dropped
            (0xFF81, 0xFE00),
            (0x7F80, 0x7C00),
        ];
        for &(b, want) in table {
            assert_eq!(f16_from_bf16(b), want, "{b:#06x}");
        }
        let tail: Vec<u64> = cycled(&inputs[0x4770..0x4790], 2100);
        let tail_expected: Vec<u16> = tail.iter().map(|&b| f16_from_bf16(b as u16)).collect();
        check_slices(
            "bf16_to_f16 long",
            bf16_to_f16,
            2,
            &tail,
            &tail_expected,
            false,
        );
        let short = &tail[..40];
        check_slices(
            "bf16_to_f16 tails",
            bf16_to_f16,
            2,
            short,
            &tail_expected[..40],
            true,
        );
    }

    #[test]
    #[cfg_attr(
        debug_assertions,
        ignore = "exhaustive sweep runs in release: cargo test --release"
    )]
    fn f32_to_bf16_all_floats() {
        sweep_all_f32("f32_to_bf16", f32_to_bf16, bf16_by_halves);
    }

    #[test]
    #[cfg_attr(
        debug_assertions,
        ignore = "exhaustive sweep runs in release: cargo test --release"
    )]
    fn f32_to_f16_all_floats() {
        sweep_all_f32("f32_to_f16", f32_to_f16, f16_by_value);
    }

    #[test]
    fn f64_witnesses() {
        let bf16: &[(u64, u16)] = &[
            (0x3FF0_1000_0000_1000, 0x3F81),
            (0x3FF0_2FFF_FFFF_F000, 0x3F81),
            (0x47EF_EFFF_FFFF_FFFF, 0x7F7F),
            (0x47EF_F000_0000_0000, 0x7F80), // overflow midpoint ties up
            (0x3790_0000_0400_0000, 0x0001),
            (0x4170_1000_1000_0000, 0x4B81),
            (0x47F0_0000_0000_0000, 0x7F80), // 2^128
            (0xC7F0_0000_0000_0000, 0xFF80),
            (0x47EF_FFFF_F000_0000, 0x7F80), // between FLT_MAX and 2^128
            (0x7FEF_FFFF_FFFF_FFFF, 0x7F80), // f64::MAX
            (0x7FF0_0000_0000_0000, 0x7F80),
            (0xFFF0_0000_0000_0000, 0xFF80),
            (0x7FF0_0000_0000_0001, 0x7FC0),
            (0xFFF8_0000_0000_0000, 0xFFC0),
            (0x0000_0000_0000_0001, 0x0000), // f64 subnormal
            (0x8000_0000_0000_0000, 0x8000),
            (0x3780_0000_0000_0000, 0x0000), // 2^-135, below half the smallest bf16
            (0x3790_0000_0000_0001, 0x0001), // just above the 2^-134 midpoint
            (0x3790_0000_0000_0000, 0x0000), // 2^-134: tie between 0 and 2^-133, to even
            (0x3810_0000_0000_0000, 0x0080), // 2^-126
        ];
        let f16: &[(u64, u16)] = &[
            (0x40EF_FE00_0000_0000, 0x7C00), // 65520 ties up to inf
            (0x40EF_FDFF_FFFF_FFFF, 0x7BFF),
            (0x47F0_0000_0000_0000, 0x7C00),
            (0x3FF0_0200_0000_0001, 0x3C01), // 1 + 2^-11 + tiny: above the tie
            (0x3FF0_0200_0000_0000, 0x3C00), // exact tie, even
            (0x3E60_0000_0000_0000, 0x0000), // 2^-25 ties to zero
            (0x3E60_0000_0000_0001, 0x0001),
            (0x3E70_0000_0000_0000, 0x0001), // 2^-24, smallest subnormal
            (0x7FF8_0000_0000_0000, 0x7E00),
            (0xFFF0_0000_0000_0001, 0xFE00),
        ];
        for &(x, want) in bf16 {
            assert_eq!(bf16_from_f64(x), want, "{x:#018x}");
            assert_eq!(
                bf16_of_value(f64::from_bits(x)),
                want,
                "reference on {x:#018x}"
            );
        }
        for &(x, want) in f16 {
            assert_eq!(f16_from_f64(x), want, "{x:#018x}");
            assert_eq!(
                f16_of_value(f64::from_bits(x)),
                want,
                "reference on {x:#018x}"
            );
        }
        let (inputs, expected): (Vec<u64>, Vec<u16>) = bf16.iter().copied().unzip();
        check_slices(
            "f64_to_bf16",
            f64_to_bf16,
            8,
            &cycled(&inputs, 100),
            &cycled(&expected, 100),
            true,
        );
        let (inputs, expected): (Vec<u64>, Vec<u16>) = f16.iter().copied().unzip();
        check_slices(
            "f64_to_f16",
            f64_to_f16,
            8,
            &cycled(&inputs, 100),
            &cycled(&expected, 100),
            true,
        );
    }

    #[test]
    fn f64_to_bf16_random_and_ties() {
        println!("seed {SEED:#x}");
        let inputs = f64_cases(&mut Rng(SEED), bf16_value, 0x7F7F, pow2(127) * 2.0);
        let expected: Vec<u16> = inputs
            .iter()
            .map(|&x| bf16_of_value(f64::from_bits(x)))
            .collect();
        for (&x, &want) in inputs.iter().zip(&expected) {
            assert_eq!(bf16_from_f64(x), want, "{x:#018x} (seed {SEED:#x})");
        }
        check_slices("f64_to_bf16", f64_to_bf16, 8, &inputs, &expected, false);
    }

    #[test]
    fn f64_to_f16_random_and_ties() {
        println!("seed {SEED:#x}");
        let inputs = f64_cases(&mut Rng(SEED ^ 1), f16_value, 0x7BFF, 65536.0);
        let expected: Vec<u16> = inputs
            .iter()
            .map(|&x| f16_of_value(f64::from_bits(x)))
            .collect();
        for (&x, &want) in inputs.iter().zip(&expected) {
            assert_eq!(f16_from_f64(x), want, "{x:#018x} (seed {SEED:#x})");
        }
        check_slices("f64_to_f16", f64_to_f16, 8, &inputs, &expected, false);
    }
    /// Sets the MXCSR flush-to-zero and denormals-are-zero bits on this thread (as a library
    /// built with -ffast-math may have done in a Python process), runs every kernel for every
    /// ISA, restores MXCSR, and compares with results computed beforehand.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn kernels_ignore_flush_to_zero_and_denormals_are_zero() {
        type ElementFn = fn(u64) -> u16;

        let mut rng = Rng(SEED);
        let halves: Vec<u64> = (0..=0xFFFF).collect();
        // f32 subnormals, f32s around f16's subnormal range, and random patterns.
        let mut floats: Vec<u64> = (0..0x1_0000).map(|i| i * 0x80 + 1).collect();
        floats.extend((0x3280_0000..0x3890_0000_u64).step_by(97));
        floats.extend((0..100_000).map(|_| rng.next() >> 32));
        let signs = floats.iter().map(|&u| u | 0x8000_0000).collect::<Vec<_>>();
        floats.extend(signs);
        // f64s around bf16's and f16's subnormal ranges, and random patterns.
        let mut doubles: Vec<u64> = Vec::new();
        for exp in (1023 - 150..1023 - 120).chain(1023 - 27..1023 - 13) {
            for _ in 0..2000 {
                doubles.push((rng.next() & (1 << 63)) | (exp << 52) | (rng.next() >> 12));
            }
        }
        doubles.extend((0..100_000).map(|_| rng.next()));

        let cases: [(&str, Kernel, usize, &[u64], ElementFn); 5] = [
            ("f32_to_bf16", f32_to_bf16, 4, &floats, |u| {
                bf16_from_f32(u as u32)
            }),
            ("f16_to_bf16", f16_to_bf16, 2, &halves, |u| {
                bf16_from_f16(u as u16)
            }),
            ("f64_to_bf16", f64_to_bf16, 8, &doubles, bf16_from_f64),
            ("f32_to_f16", f32_to_f16, 4, &floats, |u| {
                f16_from_f32(u as u32)
            }),
            ("f64_to_f16", f64_to_f16, 8, &doubles, f16_from_f64),
        ];
        let isas = Isa::available();
        let inputs: Vec<Vec<u8>> = cases.iter().map(|c| to_bytes(c.3, c.2, 0)).collect();
        let mut outputs: Vec<Vec<u8>> = Vec::new();
        crate::testutil::with_ftz_daz(|| {
            for (case, src) in cases.iter().zip(&inputs) {
                for &isa in &isas {
                    let mut dst = vec![0u8; src.len() / case.2 * 2];
                    case.1(isa, src, &mut dst);
                    outputs.push(dst);
                }
            }
        });

        let mut outputs = outputs.iter();
        for case in &cases {
            let expected: Vec<u16> = case.3.iter().map(|&x| case.4(x)).collect();
            for &isa in &isas {
                let got = to_u16s(outputs.next().unwrap());
                if let Some(i) = (0..got.len()).find(|&i| got[i] != expected[i]) {
                    panic!(
                        "{} {isa:?} under FTZ/DAZ: input {:#x}: got {:#06x}, want {:#06x}",
                        case.0, case.3[i], got[i], expected[i]
                    );
                }
            }
        }
    }

    /// Lengths that break the contract stop at the shorter side in release builds (debug
    /// builds assert); nothing is read or written out of bounds.
    #[cfg(not(debug_assertions))]
    #[test]
    fn mismatched_lengths_stay_in_bounds() {
        let src: Vec<u8> = (0..1000).map(|i| i as u8).collect();
        let kernels: [(Kernel, usize); 6] = [
            (f32_to_bf16, 4),
            (f16_to_bf16, 2),
            (f64_to_bf16, 8),
            (f32_to_f16, 4),
            (f64_to_f16, 8),
            (bf16_to_f16, 2),
        ];
        for isa in Isa::available() {
            for (kernel, size) in kernels {
                for (src_len, dst_len) in [(1000, 10), (999, 1000), (37, 3), (0, 8), (1000, 0)] {
                    let mut dst = vec![0xEE; dst_len];
                    kernel(isa, &src[..src_len], &mut dst);
                    let n = (src_len / size).min(dst_len / 2);
                    assert!(
                        dst[2 * n..].iter().all(|&b| b == 0xEE),
                        "{isa:?} {size} {src_len} {dst_len}"
                    );
                }
            }
        }
    }
}
