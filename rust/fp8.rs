//! FP8 E4M3 ("e4m3fn") quantization as llm-compressor's `model_free_ptq` does it on the CPU
//! (compressed-tensors 0.19, torch 2.14, eager path), bit for bit, and dequantization as
//! compressed-tensors' `(q.to(s.dtype) - zp.to(s.dtype)) * s` does it.
//!
//! A group (a row for FP8_DYNAMIC, a 128x128 tile for FP8_BLOCK) of weights `w` in dtype D
//! (F32, F16 or BF16) is quantized as:
//!
//! ```text
//! amax = max |w| over the group                         (exact, in D)
//! s    = round_D(f32(amax) / 448)                       (f32 division, RNE to D)
//! s    = eps(D) if s == 0                               (bf16 2^-7, f16 2^-10, f32 2^-23)
//! y    = round_D(f32(w) / f32(s))                       (f32 division, then RNE to D)
//! q    = e4m3(clamp(y, -448, 448))                      (RNE; the cast saturates anyway)
//! ```
//!
//! For BF16 and F16 `y` is rounded twice (to f32 by the division, then to D), as torch's
//! reduced-precision division does; a single rounding would differ on ~2 % of bf16 weights.
//!
//! The arithmetic is hardware f32 division plus integer rounding. Every public function
//! runs its float work with the x86 MXCSR set to its default (round to nearest, no
//! flush-to-zero, no denormals-are-zero, exceptions masked) and restores the caller's value
//! after, so a library that set FTZ/DAZ in the same process changes no result (subnormal
//! scales such as f32 `0x00000627` occur in real checkpoints). Other architectures are
//! assumed to run in their default floating-point environment.
//!
//! Slices are sized by the caller (documented per function, checked by `debug_assert`); a
//! mismatch never panics in release builds: the functions stop at the shorter side.

use safetensors::tensor::Dtype;

use crate::kernels::{bf16_from_f16, bf16_from_f32, f16_from_bf16, f16_from_f32, f32_from_f16};

/// The largest finite E4M3FN value; |x| above it saturates to it.
pub const E4M3_MAX: f32 = 448.0;

/// Tile edge of FP8_BLOCK (`block_structure [128, 128]`).
pub const BLOCK: usize = 128;

/// What FP8 did to the values of a tensor (or part of one): merged across calls.
///
/// Errors are measured against the dequantized value `f32(q) * f32(s)` (exact in f64), over
/// finite weights only. Sums are accumulated in several lanes and then added, so they are
/// not bit-identical to a sequential sum (they are measures, not results).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Fp8Stats {
    /// Elements quantized.
    pub elements: u64,
    /// max |dequant(q)*s - w| over finite w, computed in f64 from f32(w), f32(q) * f32(s).
    pub max_abs_err: f64,
    /// Σ err² (relative error = sqrt(sum_sq_err / sum_sq_src)).
    pub sum_sq_err: f64,
    /// Σ w².
    pub sum_sq_src: f64,
    /// Weights with w != 0 (finite) whose q decodes to ±0.
    pub flushed: u64,
    /// Groups (rows or tiles) quantized.
    pub groups: u64,
    /// Groups whose scale was exactly 0 and became eps(D).
    pub zero_groups: u64,
}

impl Fp8Stats {
    /// Adds `o` into `self` (counts and sums added, maxima kept).
    pub fn merge(&mut self, o: &Fp8Stats) {
        self.elements += o.elements;
        self.max_abs_err = self.max_abs_err.max(o.max_abs_err);
        self.sum_sq_err += o.sum_sq_err;
        self.sum_sq_src += o.sum_sq_src;
        self.flushed += o.flushed;
        self.groups += o.groups;
        self.zero_groups += o.zero_groups;
    }

    /// sqrt(Σ err² / Σ w²); 0 when Σ w² is 0 (all weights zero: nothing was lost).
    pub fn rel_err(&self) -> f64 {
        if self.sum_sq_src > 0.0 {
            (self.sum_sq_err / self.sum_sq_src).sqrt()
        } else {
            0.0
        }
    }
}

/// Float E4M3FN (OCP "fn"), as torch's `.to(torch.float8_e4m3fn)` on CPU does it: RNE,
/// SATURATING: |x| > 448 (incl. ±inf) → ±448 (0x7E/0xFE); NaN keeps its sign (+NaN → 0x7F,
/// -NaN → 0xFF); -0 → 0x80; subnormals kept (RNE into e4m3 subnormals, min subnormal 2^-9).
///
/// Branch-free (selects), so loops over it vectorize. Independent of FTZ/DAZ; assumes
/// round-to-nearest (the public slice functions ensure it).
#[inline(always)]
pub fn e4m3_from_f32(x: f32) -> u8 {
    let u = x.to_bits();
    let sign = ((u >> 24) & 0x80) as u8;
    let abs = u & 0x7FFF_FFFF;
    // Normal e4m3 (2^-6 <= |x| < 448): rebias the exponent from 127 to 7, then round off 20
    // mantissa bits to nearest even; a carry into the exponent is right.
    let normal =
        ((abs.wrapping_sub(120 << 23)).wrapping_add(0x7_FFFF + ((abs >> 20) & 1)) >> 20) as u8;
    // Below 2^-6 (e4m3 subnormals, units of 2^-9, and zero): adding 2^14 puts the value
    // where the f32 ulp is 2^-9, so the hardware add rounds it RNE to a whole number of
    // units; 8 units (2^-6) is code 0x08, the smallest normal, correctly. The sum is
    // normal, and a DAZ-flushed subnormal input rounds to 0 anyway.
    let sub = (f32::from_bits(abs) + 16384.0)
        .to_bits()
        .wrapping_sub(0x4680_0000) as u8;
    let magnitude = if abs > 0x7F80_0000 {
        0x7F
    } else if abs >= 0x43E0_0000 {
        0x7E
    } else if abs >= 0x3C80_0000 {
        normal
    } else {
        sub
    };
    sign | magnitude
}

/// The f32 bits of an e4m3 code (exact); 0x7F/0xFF → NaN (`0x7FF00000`/`0xFFF00000`, the
/// bits torch's `.to(torch.float32)` gives).
const fn e4m3_bits(b: u8) -> u32 {
    let sign = ((b as u32) & 0x80) << 24;
    let exp = ((b >> 3) & 0xF) as u32;
    let m = (b & 7) as u32;
    let magnitude = if exp == 15 && m == 7 {
        0x7FF0_0000
    } else if exp != 0 {
        ((exp + 120) << 23) | (m << 20)
    } else if m == 0 {
        0
    } else {
        // m * 2^-9 with the leading bit of m at position h: 1.f * 2^(h - 9).
        let h = 31 - m.leading_zeros();
        ((h + 118) << 23) | ((m - (1 << h)) << (23 - h))
    };
    sign | magnitude
}

/// Every e4m3 code's f32 value, as bits.
static E4M3_TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_bits(i as u8);
        i += 1;
    }
    t
};

/// The value of an e4m3 code as f32 (exact); 0x7F/0xFF → NaN (of that sign).
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    f32::from_bits(E4M3_TABLE[usize::from(b)])
}

/// Branch-free decode of an e4m3 code (same values as `e4m3_to_f32`, NaN codes excepted:
/// they decode to 480, never asked for), for vectorized loops where a table lookup would
/// be a gather.
#[inline(always)]
fn e4m3_value(b: u8) -> f32 {
    let sign = (u32::from(b) & 0x80) << 24;
    let m = u32::from(b & 0x7F);
    let normal = f32::from_bits(sign | ((m << 20) + (120 << 23)));
    // Subnormals (and zero): m units of 2^-9, exact.
    let sub = f32::from_bits(sign | ((m as f32) * (1.0 / 512.0)).to_bits());
    if m >= 8 {
        normal
    } else {
        sub
    }
}

/// Does this tensor data (little-endian elements of `d`: F32, F16 or BF16) hold a NaN or
/// ±inf? Other dtypes: `false`. A trailing partial element is ignored.
pub fn has_nonfinite(d: Dtype, src: &[u8]) -> bool {
    // Chunks are checked branch-free, so the check vectorizes; it stops at the first chunk
    // with a hit.
    match d {
        Dtype::F32 => src.as_chunks::<4>().0.chunks(64).any(|c| {
            c.iter().fold(false, |a, b| {
                a | (u32::from_le_bytes(*b) & 0x7F80_0000 == 0x7F80_0000)
            })
        }),
        Dtype::BF16 => any_u16(src, 0x7F80),
        Dtype::F16 => any_u16(src, 0x7C00),
        _ => false,
    }
}

/// Does any u16 have all the bits of `exp_mask` set?
fn any_u16(src: &[u8], exp_mask: u16) -> bool {
    src.as_chunks::<2>().0.chunks(128).any(|c| {
        c.iter().fold(false, |a, b| {
            a | (u16::from_le_bytes(*b) & exp_mask == exp_mask)
        })
    })
}

/// The weight dtypes, as code: decode, |x| bits for amax, rounding to D, writing a scale.
trait Elem {
    const SIZE: usize;
    /// eps(D), as f32 bits.
    const EPS: u32;
    /// Little-endian element `i` of `src` widened to f32 (exact).
    fn f32_at(src: &[u8], i: usize) -> f32;
    /// The magnitude bits of element `i`, ordered as the magnitudes (NaN above inf).
    fn abs_bits_at(src: &[u8], i: usize) -> u32;
    /// The f32 of magnitude bits (as `abs_bits_at` gives).
    fn abs_bits_to_f32(a: u32) -> f32;
    /// Rounds an f32 to D (RNE) and widens the result back to f32 (exact), as torch stores a
    /// D result of f32 arithmetic.
    fn round(x: f32) -> f32;
    /// Writes `s` (exactly a D value) as element `i` of `dst`.
    fn put(dst: &mut [u8], i: usize, s: f32);
}

struct F32;
struct Bf16;
struct F16;

#[inline(always)]
fn u16_at(src: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([src[2 * i], src[2 * i + 1]])
}

impl Elem for F32 {
    const SIZE: usize = 4;
    const EPS: u32 = 0x3400_0000;
    #[inline(always)]
    fn f32_at(src: &[u8], i: usize) -> f32 {
        f32::from_le_bytes([src[4 * i], src[4 * i + 1], src[4 * i + 2], src[4 * i + 3]])
    }
    #[inline(always)]
    fn abs_bits_at(src: &[u8], i: usize) -> u32 {
        Self::f32_at(src, i).to_bits() & 0x7FFF_FFFF
    }
    #[inline(always)]
    fn abs_bits_to_f32(a: u32) -> f32 {
        f32::from_bits(a)
    }
    #[inline(always)]
    fn round(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn put(dst: &mut [u8], i: usize, s: f32) {
        dst[4 * i..4 * i + 4].copy_from_slice(&s.to_le_bytes());
    }
}

impl Elem for Bf16 {
    const SIZE: usize = 2;
    const EPS: u32 = 0x3C00_0000;
    #[inline(always)]
    fn f32_at(src: &[u8], i: usize) -> f32 {
        f32::from_bits(u32::from(u16_at(src, i)) << 16)
    }
    #[inline(always)]
    fn abs_bits_at(src: &[u8], i: usize) -> u32 {
        u32::from(u16_at(src, i) & 0x7FFF)
    }
    #[inline(always)]
    fn abs_bits_to_f32(a: u32) -> f32 {
        f32::from_bits(a << 16)
    }
    #[inline(always)]
    fn round(x: f32) -> f32 {
        // torch's c10::BFloat16 makes every NaN +0x7FC0 (observed: an inf/inf weight
        // becomes byte 0x7F in BF16, 0xFF in F32).
        let b = bf16_from_f32(x.to_bits()) & if x.is_nan() { 0x7FFF } else { 0xFFFF };
        f32::from_bits(u32::from(b) << 16)
    }
    #[inline(always)]
    fn put(dst: &mut [u8], i: usize, s: f32) {
        dst[2 * i..2 * i + 2].copy_from_slice(&((s.to_bits() >> 16) as u16).to_le_bytes());
    }
}

impl Elem for F16 {
    const SIZE: usize = 2;
    const EPS: u32 = 0x3A80_0000;
    #[inline(always)]
    fn f32_at(src: &[u8], i: usize) -> f32 {
        f32::from_bits(f32_from_f16(u16_at(src, i)))
    }
    #[inline(always)]
    fn abs_bits_at(src: &[u8], i: usize) -> u32 {
        u32::from(u16_at(src, i) & 0x7FFF)
    }
    #[inline(always)]
    fn abs_bits_to_f32(a: u32) -> f32 {
        f32::from_bits(f32_from_f16(a as u16))
    }
    #[inline(always)]
    fn round(x: f32) -> f32 {
        f32::from_bits(f32_from_f16(f16_from_f32(x.to_bits())))
    }
    #[inline(always)]
    fn put(dst: &mut [u8], i: usize, s: f32) {
        let h = f16_from_f32(s.to_bits());
        dst[2 * i..2 * i + 2].copy_from_slice(&h.to_le_bytes());
    }
}

/// max |w| bits over `src` (whole elements of E).
#[inline(always)]
fn amax_bits<E: Elem>(src: &[u8]) -> u32 {
    let n = src.len() / E::SIZE;
    // Eight independent maxima, so the loop vectorizes without reassociation worries
    // (integer max is associative anyway).
    let mut acc = [0u32; 8];
    let full = n / 8 * 8;
    for c in (0..full).step_by(8) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = (*a).max(E::abs_bits_at(src, c + l));
        }
    }
    let mut m = acc.into_iter().max().unwrap_or(0);
    for i in full..n {
        m = m.max(E::abs_bits_at(src, i));
    }
    m
}

/// The scale of a group with max |w| = `amax` (f32 of a D value): `round_D(amax / 448)`,
/// eps(D) for an exact 0. Returns the scale (a D value as f32) and whether it was 0.
#[inline(always)]
fn scale_of<E: Elem>(amax: f32) -> (f32, bool) {
    let s = E::round(amax / E4M3_MAX);
    if s == 0.0 {
        (f32::from_bits(E::EPS), true)
    } else {
        (s, false)
    }
}

/// Statistic lanes: independent accumulators so the f64 sums vectorize.
const LANES: usize = 8;

/// Per-lane running statistics of one call.
#[derive(Default)]
struct Acc {
    max_err: [f64; LANES],
    sq_err: [f64; LANES],
    sq_src: [f64; LANES],
    flushed: [u64; LANES],
    elements: u64,
}

impl Acc {
    fn finish(&self, groups: u64, zero_groups: u64) -> Fp8Stats {
        Fp8Stats {
            elements: self.elements,
            max_abs_err: self.max_err.iter().fold(0.0, |a, &b| a.max(b)),
            sum_sq_err: self.sq_err.iter().sum(),
            sum_sq_src: self.sq_src.iter().sum(),
            flushed: self.flushed.iter().sum(),
            groups,
            zero_groups,
        }
    }
}

/// The code of one element `x` with scale `s` (as f32).
#[inline(always)]
fn quantize_one<E: Elem>(x: f32, s: f32) -> u8 {
    e4m3_from_f32(E::round(x / s))
}

/// Records the error of element `x`, quantized to code `b` with scale `s`, in lane `l`.
#[inline(always)]
fn measure_one(x: f32, b: u8, s: f32, acc: &mut Acc, l: usize) {
    let finite = x.is_finite();
    let xd = f64::from(x);
    let err = (f64::from(e4m3_value(b)) * f64::from(s) - xd).abs();
    let (err, xd) = if finite { (err, xd) } else { (0.0, 0.0) };
    acc.max_err[l] = if err > acc.max_err[l] {
        err
    } else {
        acc.max_err[l]
    };
    acc.sq_err[l] += err * err;
    acc.sq_src[l] += xd * xd;
    acc.flushed[l] += u64::from(finite & (x != 0.0) & (b & 0x7F == 0));
}

/// Quantizes the elements of `src` (whole elements of E) with scale `s` into `q`, then
/// measures them: two flat loops the compiler vectorizes (the codes), and lane-wise
/// accumulators (the statistics).
#[inline(always)]
fn quantize_run<E: Elem>(src: &[u8], s: f32, q: &mut [u8], acc: &mut Acc) {
    let n = (src.len() / E::SIZE).min(q.len());
    let (src, q) = (&src[..n * E::SIZE], &mut q[..n]);
    for (b, x) in q.iter_mut().zip(src.chunks_exact(E::SIZE)) {
        *b = quantize_one::<E>(E::f32_at(x, 0), s);
    }
    let full = n / LANES * LANES;
    // Local lane accumulators (registers, not the caller's memory), one straight-line
    // step per chunk: the compiler packs the lanes into vectors.
    let mut local = Acc::default();
    for (sc, qc) in src[..full * E::SIZE]
        .chunks_exact(LANES * E::SIZE)
        .zip(q[..full].chunks_exact(LANES))
    {
        let mut x = [0f32; LANES];
        let mut v = [0f32; LANES];
        for l in 0..LANES {
            x[l] = E::f32_at(sc, l);
            v[l] = e4m3_value(qc[l]);
        }
        for l in 0..LANES {
            let finite = x[l].is_finite();
            let xd = if finite { f64::from(x[l]) } else { 0.0 };
            let dq = if finite {
                f64::from(v[l]) * f64::from(s)
            } else {
                0.0
            };
            let err = (dq - xd).abs();
            local.max_err[l] = if err > local.max_err[l] {
                err
            } else {
                local.max_err[l]
            };
            local.sq_err[l] += err * err;
            local.sq_src[l] += xd * xd;
            local.flushed[l] += u64::from(finite & (x[l] != 0.0) & (qc[l] & 0x7F == 0));
        }
    }
    for l in 0..LANES {
        acc.max_err[l] = acc.max_err[l].max(local.max_err[l]);
        acc.sq_err[l] += local.sq_err[l];
        acc.sq_src[l] += local.sq_src[l];
        acc.flushed[l] += local.flushed[l];
    }
    for (i, &b) in q.iter().enumerate().skip(full) {
        measure_one(E::f32_at(src, i), b, s, acc, 0);
    }
    acc.elements += n as u64;
}

/// Defines `$name`, which runs `$body` (an `#[inline(always)]` fn generic over `$g`)
/// compiled for the best instruction set this CPU has (AVX-512, AVX2 or the baseline): the
/// same Rust code, so the same results (IEEE operations only, never contracted), in wider
/// vectors.
macro_rules! best_isa {
    ($name:ident, $body:ident, <$($g:ident: $b:path),*>, ($($p:ident: $t:ty),*) -> $ret:ty) => {
        #[inline(never)]
        #[allow(clippy::too_many_arguments)]
        fn $name<$($g: $b),*>($($p: $t),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
                #[allow(clippy::too_many_arguments)]
                fn avx512<$($g: $b),*>($($p: $t),*) -> $ret {
                    $body::<$($g),*>($($p),*)
                }
                #[target_feature(enable = "avx2,f16c")]
                #[allow(clippy::too_many_arguments)]
                fn avx2<$($g: $b),*>($($p: $t),*) -> $ret {
                    $body::<$($g),*>($($p),*)
                }
                match crate::kernels::Isa::detect() {
                    // SAFETY: detect() returns Avx512 only when the CPU has avx512f,
                    // avx512bw, avx2 and f16c.
                    crate::kernels::Isa::Avx512 => return unsafe { avx512::<$($g),*>($($p),*) },
                    // SAFETY: detect() returns Avx2 only when the CPU has avx2 and f16c.
                    crate::kernels::Isa::Avx2 => return unsafe { avx2::<$($g),*>($($p),*) },
                    crate::kernels::Isa::Scalar => {}
                }
            }
            $body::<$($g),*>($($p),*)
        }
    };
}

/// Saves the caller's MXCSR and sets the default one (RNE, no FTZ/DAZ, exceptions
/// masked) for the life of the guard; restores the saved value on drop (also on unwind).
/// `packed` runs its float work under it too.
pub(crate) struct FpEnv {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

#[cfg(target_arch = "x86_64")]
impl FpEnv {
    const DEFAULT: u32 = 0x1F80;

    pub(crate) fn enter() -> FpEnv {
        use std::arch::asm;
        let mut saved = 0u32;
        // SAFETY: stmxcsr stores 4 bytes into the local it is given.
        unsafe { asm!("stmxcsr [{}]", in(reg) &mut saved, options(nostack)) };
        // The flags (low 6 bits) are sticky status only; compare the control bits.
        if saved & !0x3F != Self::DEFAULT {
            let csr = Self::DEFAULT;
            // SAFETY: ldmxcsr reads 4 bytes from the local it is given; it sets the default
            // floating-point environment, which is what the compiled code assumes.
            unsafe { asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack)) };
        }
        FpEnv { saved }
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for FpEnv {
    fn drop(&mut self) {
        if self.saved & !0x3F != Self::DEFAULT {
            use std::arch::asm;
            // SAFETY: ldmxcsr reads 4 bytes from the field it is given: the caller's value.
            unsafe { asm!("ldmxcsr [{}]", in(reg) &self.saved, options(nostack)) };
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
impl FpEnv {
    pub(crate) fn enter() -> FpEnv {
        FpEnv {}
    }
}

/// Per-row (FP8_DYNAMIC, "channel") quantization of whole rows: src holds n =
/// src.len()/(cols*size(d)) rows of `cols` elements of d (F32, F16 or BF16); writes q
/// (n*cols bytes, e4m3) and scales (n elements of d, little-endian bytes). Returns stats.
///
/// Another dtype, or `cols == 0`, writes nothing and returns empty stats.
pub fn quantize_channel(
    d: Dtype,
    cols: usize,
    src: &[u8],
    q: &mut [u8],
    scales: &mut [u8],
) -> Fp8Stats {
    let _env = FpEnv::enter();
    match d {
        Dtype::F32 => channel::<F32>(cols, src, q, scales),
        Dtype::BF16 => channel::<Bf16>(cols, src, q, scales),
        Dtype::F16 => channel::<F16>(cols, src, q, scales),
        _ => Fp8Stats::default(),
    }
}

best_isa!(channel, channel_body, <E: Elem>, (cols: usize, src: &[u8], q: &mut [u8], scales: &mut [u8]) -> Fp8Stats);

#[inline(always)]
fn channel_body<E: Elem>(cols: usize, src: &[u8], q: &mut [u8], scales: &mut [u8]) -> Fp8Stats {
    // A width no slice can hold (from a corrupt shape) quantizes nothing.
    let Some(row_bytes) = cols.checked_mul(E::SIZE).filter(|&b| b > 0) else {
        return Fp8Stats::default();
    };
    let n = src.len() / row_bytes;
    debug_assert_eq!(src.len(), n * row_bytes, "src holds whole rows");
    debug_assert_eq!(q.len(), n * cols, "q holds n*cols bytes");
    debug_assert_eq!(scales.len(), n * E::SIZE, "scales holds n elements");
    let n = n.min(q.len() / cols).min(scales.len() / E::SIZE);
    let mut acc = Acc::default();
    let mut zero_groups = 0;
    for (r, (row, qrow)) in src
        .chunks_exact(row_bytes)
        .zip(q.chunks_exact_mut(cols))
        .take(n)
        .enumerate()
    {
        let (s, zero) = scale_of::<E>(E::abs_bits_to_f32(amax_bits::<E>(row)));
        zero_groups += u64::from(zero);
        E::put(scales, r, s);
        quantize_run::<E>(row, s, qrow, &mut acc);
    }
    acc.finish(n as u64, zero_groups)
}

/// FP8_BLOCK: src holds one band of 1..=128 whole rows of `cols` elements of d (F32, F16 or
/// BF16); tiles are 128x128, the last tile in a row partial (cols % 128), amax over the
/// real elements only. Writes q (rows*cols bytes) and scales (ceil(cols/128) elements of d).
///
/// A band of more than 128 rows is quantized as one band of tiles that tall (the caller's
/// mistake; debug builds assert). Another dtype, or `cols == 0`, writes nothing.
pub fn quantize_band(
    d: Dtype,
    cols: usize,
    src: &[u8],
    q: &mut [u8],
    scales: &mut [u8],
) -> Fp8Stats {
    let _env = FpEnv::enter();
    match d {
        Dtype::F32 => band::<F32>(cols, src, q, scales),
        Dtype::BF16 => band::<Bf16>(cols, src, q, scales),
        Dtype::F16 => band::<F16>(cols, src, q, scales),
        _ => Fp8Stats::default(),
    }
}

best_isa!(band, band_body, <E: Elem>, (cols: usize, src: &[u8], q: &mut [u8], scales: &mut [u8]) -> Fp8Stats);

#[inline(always)]
fn band_body<E: Elem>(cols: usize, src: &[u8], q: &mut [u8], scales: &mut [u8]) -> Fp8Stats {
    // A width no slice can hold (from a corrupt shape) quantizes nothing.
    let Some(row_bytes) = cols.checked_mul(E::SIZE).filter(|&b| b > 0) else {
        return Fp8Stats::default();
    };
    let rows = src.len() / row_bytes;
    let tiles = cols.div_ceil(BLOCK);
    debug_assert_eq!(src.len(), rows * row_bytes, "src holds whole rows");
    debug_assert!(
        (1..=BLOCK).contains(&rows),
        "a band has 1..=128 rows, not {rows}"
    );
    debug_assert_eq!(q.len(), rows * cols, "q holds rows*cols bytes");
    debug_assert_eq!(
        scales.len(),
        tiles * E::SIZE,
        "scales holds ceil(cols/128) elements"
    );
    let rows = rows.min(q.len() / cols);
    let tiles = tiles.min(scales.len() / E::SIZE);
    let mut acc = Acc::default();
    let mut zero_groups = 0;
    // Tile by tile: its rows are read twice (amax, then quantize) while in cache.
    for t in 0..tiles {
        let c0 = t * BLOCK;
        let c1 = (c0 + BLOCK).min(cols);
        let seg = |r: usize| &src[r * row_bytes + c0 * E::SIZE..r * row_bytes + c1 * E::SIZE];
        let amax = (0..rows).fold(0, |m, r| m.max(amax_bits::<E>(seg(r))));
        let (s, zero) = scale_of::<E>(E::abs_bits_to_f32(amax));
        zero_groups += u64::from(zero);
        E::put(scales, t, s);
        for r in 0..rows {
            quantize_run::<E>(seg(r), s, &mut q[r * cols + c0..r * cols + c1], &mut acc);
        }
    }
    acc.finish(tiles as u64, zero_groups)
}

/// Which scale each element of a quantized tensor uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleLayout {
    /// One scale for the whole tensor.
    Tensor,
    /// One scale per row (`[R, 1]`).
    Channel,
    /// One scale per tile of `rows` x `cols` (128x128 for compressed-tensors and DeepSeek
    /// blocks, 1 x the group size for groups); scales row-major `[ceil(R/rows),
    /// ceil(C/cols)]`, edge tiles partial.
    Block { rows: usize, cols: usize },
}

/// A weight's zero points (compressed-tensors' asymmetric schemes): the WHOLE tensor,
/// little-endian `dtype` (F8_E4M3, I8, I16 or I32; see `quant::ZERO_POINT_DTYPES`), element
/// `i` belonging to the group of scale `i`.
#[derive(Clone, Copy, Debug)]
pub struct ZeroPoints<'a> {
    pub dtype: Dtype,
    pub data: &'a [u8],
}

impl ZeroPoints<'_> {
    /// Zero point `i` as f32, as torch's `.to(float32)` gives it: exact for E4M3, I8 and
    /// I16; I32 rounded to nearest even (Rust's `as`, as C's int-to-float conversion under
    /// the default rounding mode). None for a zero point the tensor lacks, or another dtype.
    fn at(&self, i: usize) -> Option<f32> {
        let d = self.data;
        Some(match self.dtype {
            Dtype::F8_E4M3 => e4m3_to_f32(*d.get(i)?),
            Dtype::I8 => f32::from(*d.get(i)? as i8),
            Dtype::I16 => f32::from(i16::from_le_bytes(*d.get(2 * i..)?.first_chunk()?)),
            Dtype::I32 => i32::from_le_bytes(*d.get(4 * i..)?.first_chunk()?) as f32,
            _ => return None,
        })
    }
}

/// How the dequantization loop reads a scale: its byte size and a reader of element `i`.
type ScaleReader = (usize, fn(&[u8], usize) -> f32);

/// Dequantize whole rows of e4m3 `q` (starting at row `row0` of the tensor, `cols` wide)
/// into `dst` of dtype `target` (BF16 or F16) as compressed-tensors' `_dequantize` does in
/// the scale's dtype S (F32, BF16 or F16), each step rounded to S (for bf16/f16 on CPU torch
/// computes in f32 and rounds RNE to S):
///
/// ```text
/// x   = f32(q)                                   (q.to(S): exact in every S)
/// x   = round_S(x - round_S(f32(zp)))            (only with zero points: zp.to(S), then -)
/// out = target(round_S(x * f32(s)))              (* scale, then .to(target), RNE)
/// ```
///
/// `scales` is the WHOLE scale tensor (little-endian S), `zero_points` the whole zero-point
/// tensor if the weight has one; `layout` says which scale (and zero point) an element
/// uses. docs/rounding.md derives these steps from compressed-tensors' source.
///
/// Sizes: `q.len()` is a multiple of `cols`, `dst.len() == 2 * q.len()`, and `scales` (and
/// `zero_points`) hold every one the rows use. A scale or zero point the tensor lacks reads
/// as NaN (never a panic); an unsupported dtype, `cols == 0` or an empty tile size writes
/// nothing.
// The signature is the converter's interface, agreed as is.
#[allow(clippy::too_many_arguments)]
pub fn dequantize(
    layout: ScaleLayout,
    s_dtype: Dtype,
    scales: &[u8],
    zero_points: Option<ZeroPoints<'_>>,
    cols: usize,
    row0: usize,
    q: &[u8],
    target: Dtype,
    dst: &mut [u8],
) {
    debug_assert!(
        cols > 0 && q.len().is_multiple_of(cols),
        "q holds whole rows"
    );
    debug_assert_eq!(dst.len(), 2 * q.len(), "dst holds 2 bytes per element");
    let _env = FpEnv::enter();
    let z = zero_points;
    match (s_dtype, target) {
        (Dtype::F32, Dtype::BF16) => dequant(
            layout,
            (scales, z),
            cols,
            row0,
            q,
            dst,
            (4, F32::f32_at),
            F32::round,
            |p| bf16_from_f32(p.to_bits()),
        ),
        (Dtype::F32, Dtype::F16) => dequant(
            layout,
            (scales, z),
            cols,
            row0,
            q,
            dst,
            (4, F32::f32_at),
            F32::round,
            |p| f16_from_f32(p.to_bits()),
        ),
        (Dtype::BF16, Dtype::BF16) => dequant(
            layout,
            (scales, z),
            cols,
            row0,
            q,
            dst,
            (2, Bf16::f32_at),
            Bf16::round,
            |p| bf16_from_f32(p.to_bits()),
        ),
        (Dtype::BF16, Dtype::F16) => dequant(
            layout,
            (scales, z),
            cols,
            row0,
            q,
            dst,
            (2, Bf16::f32_at),
            Bf16::round,
            |p| f16_from_bf16(bf16_from_f32(p.to_bits())),
        ),
        (Dtype::F16, Dtype::BF16) => dequant(
            layout,
            (scales, z),
            cols,
            row0,
            q,
            dst,
            (2, F16::f32_at),
            F16::round,
            |p| bf16_from_f16(f16_from_f32(p.to_bits())),
        ),
        (Dtype::F16, Dtype::F16) => dequant(
            layout,
            (scales, z),
            cols,
            row0,
            q,
            dst,
            (2, F16::f32_at),
            F16::round,
            |p| f16_from_f32(p.to_bits()),
        ),
        // compressed-tensors `mxfp8-quantized`: U8 E8M0 exponents, read as BF16 scales
        // (`decompress_mx_scale`), then as a BF16 scale.
        (Dtype::U8, Dtype::BF16) => dequant(
            layout,
            (scales, z),
            cols,
            row0,
            q,
            dst,
            (1, e8m0_at),
            Bf16::round,
            |p| bf16_from_f32(p.to_bits()),
        ),
        (Dtype::U8, Dtype::F16) => dequant(
            layout,
            (scales, z),
            cols,
            row0,
            q,
            dst,
            (1, e8m0_at),
            Bf16::round,
            |p| f16_from_bf16(bf16_from_f32(p.to_bits())),
        ),
        _ => {}
    }
}

/// Dequantize as `dequantize` does, for a `weight_scale_inv` (transformers' `Fp8Dequantize`,
/// DeepSeek's `weight_dequant`, compressed-tensors' `FP8BlockDequantizer`): the scale read
/// in f32 whatever its dtype (F32, BF16, F16; E8M0 exponents in F8_E8M0 or U8), the f32
/// product rounded once to `target`: `target(f32(q) * f32(s))`, never to the scale's dtype
/// first. No zero points (that format has none).
// The signature is `dequantize`'s.
#[allow(clippy::too_many_arguments)]
pub fn dequantize_once(
    layout: ScaleLayout,
    s_dtype: Dtype,
    scales: &[u8],
    cols: usize,
    row0: usize,
    q: &[u8],
    target: Dtype,
    dst: &mut [u8],
) {
    debug_assert!(
        cols > 0 && q.len().is_multiple_of(cols),
        "q holds whole rows"
    );
    debug_assert_eq!(dst.len(), 2 * q.len(), "dst holds 2 bytes per element");
    let _env = FpEnv::enter();
    let reader: ScaleReader = match s_dtype {
        Dtype::F32 => (4, F32::f32_at),
        Dtype::BF16 => (2, Bf16::f32_at),
        Dtype::F16 => (2, F16::f32_at),
        // transformers: U8 `(s.to(float32) - 127).exp2()` (255 is +inf), F8_E8M0
        // `s.to(float32)` (255 is NaN).
        Dtype::U8 => (1, e8m0_at),
        Dtype::F8_E8M0 => (1, e8m0fnu_at),
        _ => return,
    };
    match target {
        Dtype::BF16 => dequant(
            layout,
            (scales, None),
            cols,
            row0,
            q,
            dst,
            reader,
            F32::round,
            |p| bf16_from_f32(p.to_bits()),
        ),
        Dtype::F16 => dequant(
            layout,
            (scales, None),
            cols,
            row0,
            q,
            dst,
            reader,
            F32::round,
            |p| f16_from_f32(p.to_bits()),
        ),
        _ => {}
    }
}

/// An E8M0 scale byte's value as compressed-tensors' `decompress_mx_scale` gives it,
/// `2.0 ** (b - 127).to(bfloat16)`: `2^(b - 127)` in BF16, so 2^-127 (a subnormal) for 0 and
/// +inf for 255 (2^128 overflows). (gpt-oss's `ldexp` keeps 2^128: `gptoss_scale`.)
#[inline(always)]
pub fn e8m0(b: u8) -> f32 {
    match b {
        0 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits(u32::from(b) << 23), // 255 << 23 is +inf
    }
}

/// E8M0 scale `i` stored as a U8 exponent: `2^(b - 127)`, 255 is +inf (`e8m0`).
fn e8m0_at(src: &[u8], i: usize) -> f32 {
    e8m0(src[i])
}

/// E8M0 scale `i` in torch's `float8_e8m0fnu`, `.to(float32)`: `2^(b - 127)`, 255 is NaN.
fn e8m0fnu_at(src: &[u8], i: usize) -> f32 {
    match src[i] {
        0xFF => f32::NAN,
        b => e8m0(b),
    }
}

/// A weight's scale tensor and zero points, as `dequant_body` reads them.
type Params<'a> = (&'a [u8], Option<ZeroPoints<'a>>);

best_isa!(dequant, dequant_body, <R: Fn(f32) -> f32, F: Fn(f32) -> u16>, (layout: ScaleLayout, params: Params<'_>, cols: usize, row0: usize, q: &[u8], dst: &mut [u8], reader: ScaleReader, round: R, out: F) -> ());

/// The dequantization loop for one (scale dtype, target) pair: `scale_at` reads scale `i`
/// (of `s_size` bytes), `round` rounds an f32 to S, `out` rounds the f32 product to the
/// target's bits through S.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn dequant_body<R: Fn(f32) -> f32, F: Fn(f32) -> u16>(
    layout: ScaleLayout,
    (scales, zero_points): Params<'_>,
    cols: usize,
    row0: usize,
    q: &[u8],
    dst: &mut [u8],
    (s_size, scale_at): ScaleReader,
    round: R,
    out: F,
) {
    let n_scales = scales.len() / s_size;
    let scale = |i: usize| {
        if i < n_scales {
            scale_at(scales, i)
        } else {
            f32::NAN
        }
    };
    // zp.to(S), as f32; None without zero points.
    let zero = |i: usize| zero_points.map(|z| round(z.at(i).unwrap_or(f32::NAN)));
    let (block_rows, block_cols) = match layout {
        ScaleLayout::Tensor => (usize::MAX, usize::MAX),
        ScaleLayout::Channel => (1, usize::MAX),
        ScaleLayout::Block { rows, cols } => (rows, cols),
    };
    if cols == 0 || cols > q.len() || block_rows == 0 || block_cols == 0 {
        return;
    }
    let tiles_per_row = cols.div_ceil(block_cols);
    let run = |q: &[u8], i: usize, d: &mut [u8]| {
        let s = scale(i);
        let d = d.as_chunks_mut::<2>().0;
        match zero(i) {
            None => {
                for (b, o) in q.iter().zip(d.iter_mut()) {
                    *o = out(e4m3_value(*b) * s).to_le_bytes();
                }
                // NaN codes (0x7F/0xFF) are rare: patched after the vectorized loop.
                for (b, o) in q.iter().zip(d.iter_mut()) {
                    if *b & 0x7F == 0x7F {
                        *o = out(e4m3_to_f32(*b) * s).to_le_bytes();
                    }
                }
            }
            Some(z) => {
                for (b, o) in q.iter().zip(d.iter_mut()) {
                    *o = out(round(e4m3_value(*b) - z) * s).to_le_bytes();
                }
                for (b, o) in q.iter().zip(d.iter_mut()) {
                    if *b & 0x7F == 0x7F {
                        *o = out(round(e4m3_to_f32(*b) - z) * s).to_le_bytes();
                    }
                }
            }
        }
    };
    for (r, (qrow, drow)) in q
        .chunks_exact(cols)
        .zip(dst.chunks_exact_mut(2 * cols))
        .enumerate()
    {
        let row = row0.saturating_add(r);
        let tile_row = row / block_rows;
        match layout {
            ScaleLayout::Tensor => run(qrow, 0, drow),
            ScaleLayout::Channel => run(qrow, row, drow),
            ScaleLayout::Block { .. } => {
                for (t, (qt, dt)) in qrow
                    .chunks(block_cols)
                    .zip(drow.chunks_mut(block_cols.saturating_mul(2)))
                    .enumerate()
                {
                    let i = tile_row.saturating_mul(tiles_per_row).saturating_add(t);
                    run(qt, i, dt);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
