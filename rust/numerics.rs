//! The numeric report: what rounding did to the values of each converted tensor.
//!
//! `measure` reads a window's source bytes and the kernel's output for them, right after the
//! kernel wrote it (so both are still in cache), and counts what was lost. Everything is
//! computed from the bits: integer masks for the counts, and for the errors an integer
//! distance turned into floats by exact conversions. No result depends on the MXCSR
//! flush-to-zero or denormals-are-zero bits, which another library in a Python process may
//! have set (plain float subtraction would lose every error near the subnormal range).

use crate::dtype::Conversion;
use crate::kernels::Isa;

/// What the rounding of one tensor (or several, merged) did, counted in elements.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Numerics {
    /// Elements measured.
    pub elements: u64,
    /// Finite inputs that became ±inf.
    pub overflow: u64,
    /// Non-zero inputs that became ±0.
    pub underflow_to_zero: u64,
    /// Non-zero outputs whose exponent field is zero.
    pub subnormal: u64,
    /// NaNs in the source.
    pub nan_in: u64,
    /// ±inf in the source.
    pub inf_in: u64,
    /// Largest |out - in| over finite inputs with finite outputs (exact).
    pub max_abs_error: f64,
    /// Largest |out - in| / |in| over inputs at or above the target's smallest normal (2^-126
    /// for bf16, 2^-14 for f16) with finite outputs, rounded once in the source's precision
    /// (f32 for F32 and F16 sources, f64 for F64).
    pub max_rel_error: f64,
}

impl Numerics {
    /// Add `other`'s counts to ours and keep the larger errors.
    pub fn merge(&mut self, other: &Numerics) {
        self.elements += other.elements;
        self.overflow += other.overflow;
        self.underflow_to_zero += other.underflow_to_zero;
        self.subnormal += other.subnormal;
        self.nan_in += other.nan_in;
        self.inf_in += other.inf_in;
        self.max_abs_error = self.max_abs_error.max(other.max_abs_error);
        self.max_rel_error = self.max_rel_error.max(other.max_rel_error);
    }

    /// The sum of several: the numbers of a whole file.
    pub fn total<'a>(all: impl IntoIterator<Item = &'a Numerics>) -> Numerics {
        let mut total = Numerics::default();
        for n in all {
            total.merge(n);
        }
        total
    }
}

/// One weight a quantized input dequantized: its output name, its format
/// (`quant::Format::text`), and the values it came to.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DequantizedTensor {
    pub name: String,
    pub format: String,
    #[serde(flatten)]
    pub range: Range,
}

/// The values a dequantized weight came to, in its target dtype (BF16 or F16): how many,
/// the smallest and largest finite one (None when none is), the NaNs and the ±infinities.
/// Read from the bits, so no MXCSR mode changes them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Range {
    pub elements: u64,
    pub min: Option<f64>,
    pub max: Option<f64>,
    pub nan: u64,
    pub inf: u64,
}

impl Range {
    /// A dequantized window's values as a conversion's numerics: its elements, and as
    /// overflow its infinities (no code holds one: each is a finite value that overflowed).
    pub fn numerics(&self) -> Numerics {
        Numerics {
            elements: self.elements,
            overflow: self.inf,
            ..Numerics::default()
        }
    }

    /// The range of `data`, 2-byte BF16 (`bf16`) or F16 values, little-endian.
    pub fn of(bf16: bool, data: &[u8]) -> Range {
        let (exp, mant): (u16, u16) = if bf16 {
            (0x7F80, 0x007F)
        } else {
            (0x7C00, 0x03FF)
        };
        // Finite values ordered as integers: negative ones flipped below the positive ones.
        let key = |v: u16| if v & 0x8000 != 0 { !v } else { v | 0x8000 };
        let (mut lo, mut hi, mut nan, mut inf) = (u16::MAX, 0u16, 0u64, 0u64);
        let values = data.as_chunks::<2>().0;
        for b in values {
            let v = u16::from_le_bytes(*b);
            if v & exp == exp {
                if v & mant == 0 {
                    inf += 1;
                } else {
                    nan += 1;
                }
                continue;
            }
            let k = key(v);
            lo = lo.min(k);
            hi = hi.max(k);
        }
        let finite = (values.len() as u64) > nan + inf;
        let value = |k: u16| {
            let v = if k & 0x8000 != 0 { k & 0x7FFF } else { !k };
            half_value(v, bf16)
        };
        Range {
            elements: values.len() as u64,
            min: finite.then(|| value(lo)),
            max: finite.then(|| value(hi)),
            nan,
            inf,
        }
    }

    /// Add `other`'s values to ours.
    pub fn merge(&mut self, other: &Range) {
        self.elements += other.elements;
        self.nan += other.nan;
        self.inf += other.inf;
        let pick = |a: Option<f64>, b: Option<f64>, f: fn(f64, f64) -> f64| match (a, b) {
            (Some(a), Some(b)) => Some(f(a, b)),
            (a, b) => a.or(b),
        };
        self.min = pick(self.min, other.min, f64::min);
        self.max = pick(self.max, other.max, f64::max);
    }
}

/// The value of finite BF16 (`bf16`) or F16 bits `v`, exactly, by integer arithmetic and one
/// product of normal f64s (a subnormal of either is normal in f64).
fn half_value(v: u16, bf16: bool) -> f64 {
    let (mbits, bias) = if bf16 { (7u32, 127i32) } else { (10, 15) };
    let e = i32::from((v & 0x7FFF) >> mbits);
    let m = u64::from(v & ((1 << mbits) - 1));
    let (m, e) = if e == 0 {
        (m, 1 - bias - mbits as i32)
    } else {
        (m | (1 << mbits), e - bias - mbits as i32)
    };
    let magnitude = m as f64 * f64::from_bits(((e + 1023) as u64) << 52);
    if v & 0x8000 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// Statistics of one converted window: `src` source bytes, `dst` the kernel's output for them.
///
/// With mismatched lengths only the elements both sides hold are measured.
pub fn measure(conv: Conversion, src: &[u8], dst: &[u8]) -> Numerics {
    measure_with(Isa::detect(), conv, src, dst)
}

/// `measure` compiled for `isa` (an ISA this CPU lacks runs the scalar code). Every ISA
/// gives the same numbers; only the speed differs.
pub fn measure_with(isa: Isa, conv: Conversion, src: &[u8], dst: &[u8]) -> Numerics {
    match isa.usable() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: usable() returns Avx512 only when the CPU has avx512f and avx512bw.
        Isa::Avx512 => unsafe { measure_avx512(conv, src, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: usable() returns Avx2 only when the CPU has avx2.
        Isa::Avx2 => unsafe { measure_avx2(conv, src, dst) },
        _ => measure_any(conv, src, dst),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn measure_avx512(conv: Conversion, src: &[u8], dst: &[u8]) -> Numerics {
    measure_any(conv, src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn measure_avx2(conv: Conversion, src: &[u8], dst: &[u8]) -> Numerics {
    measure_any(conv, src, dst)
}

/// The loops, inlined into each ISA's wrapper so that LLVM vectorises them for it.
#[inline(always)]
fn measure_any(conv: Conversion, src: &[u8], dst: &[u8]) -> Numerics {
    match conv {
        // `load` gives the source as f32 bits: with their sign when SIGNED, else |x|.
        Conversion::F32ToBf16 => measure32::<4, false, true>(src, dst, u32::from_le_bytes),
        Conversion::F16ToBf16 => measure32::<2, false, false>(src, dst, |b| {
            widen_f16(u32::from(u16::from_le_bytes(b)) & 0x7FFF)
        }),
        Conversion::F32ToF16 => measure32::<4, true, true>(src, dst, u32::from_le_bytes),
        Conversion::Bf16ToF16 => {
            measure32::<2, true, true>(src, dst, |b| u32::from(u16::from_le_bytes(b)) << 16)
        }
        Conversion::F64ToBf16 => measure64::<false>(src, dst),
        Conversion::F64ToF16 => measure64::<true>(src, dst),
    }
}

/// Elements per block: counts of a block fit in u32 lanes, and LLVM vectorises the fixed
/// trip count without a remainder loop.
const BLOCK: usize = 1024;

/// Sums over blocks. Errors are kept as keys (see `abs_key32`) and decoded once at the end.
#[derive(Default)]
struct Tally<K> {
    elements: u64,
    overflow: u64,
    underflow_to_zero: u64,
    subnormal: u64,
    nan_in: u64,
    inf_in: u64,
    abs_key: K,
    rel_bits: K,
}

/// Exponent field of a 16-bit target: all ones is ±inf or NaN, zero is ±0 or subnormal.
const fn exp_mask(f16_out: bool) -> u32 {
    if f16_out {
        0x7C00
    } else {
        0x7F80
    }
}

/// Magnitude bits of a 16-bit output as f32 bits (exact for finite values).
#[inline(always)]
fn widen_out(o: u32, f16_out: bool) -> u32 {
    if f16_out {
        widen_f16(o)
    } else {
        o << 16
    }
}

/// f32 bits of the f16 magnitude `a` (`a <= 0x7FFF`), exact; ±inf and NaN stay so.
#[inline(always)]
fn widen_f16(a: u32) -> u32 {
    // Rebias the exponent from 15 to 127, or from 15 to 255 for ±inf and NaN.
    let normal = (a << 13).wrapping_add(112 << 23);
    // Zero and subnormals are a * 2^-24: `a` converts exactly, and the product is exact and
    // zero or normal, so no MXCSR mode changes it.
    let small = (a as i32 as f32 * (1.0 / 16_777_216.0)).to_bits();
    if a < 0x0400 {
        small
    } else if a >= 0x7C00 {
        normal.wrapping_add(112 << 23)
    } else {
        normal
    }
}

// The errors. For a finite input x and finite output y != 0 of the same sign, y lies in x's
// binade or on the power of two above it, since every power of two down to the target's
// smallest subnormal is on the target's grid (and below the smallest normal, where the bits
// of the source format are linear in the value, this holds down to zero). So
// |y - x| = d * ulp(x) with d the integer distance between their bit patterns: less than 2^23
// for F32 and F16 sources, 2^52 for F64. Then the relative error is d / significand(x), one
// correctly rounded division of two exact integers. When y is 0 and x normal, the error is |x|.
//
// A key is an error as float bits with a wider exponent field: the exponent of d as a float
// plus that of ulp(x), so keys compare as the errors do, and never underflow.

/// Key of the error d * 2^(max(e, 1) - 150), or |x| when y is 0; value (1.m) * 2^(E - 277)
/// for a key with exponent field E (at most 396, so it fits in u32).
#[inline(always)]
fn abs_key32(xa: u32, ya: u32, d: u32, d_float: f32) -> u32 {
    let e = xa >> 23;
    let key = d_float.to_bits().wrapping_add(e.max(1) << 23);
    if ya == 0 && e != 0 {
        xa.wrapping_add(150 << 23)
    } else if d == 0 {
        0
    } else {
        key
    }
}

fn decode_abs32(key: u32) -> f64 {
    if key == 0 {
        return 0.0;
    }
    let (e, m) = (u64::from(key >> 23), u64::from(key & 0x7F_FFFF));
    // Value exponent e - 277 is within f64's normal range: [-276, 119].
    f64::from_bits(((e + 1023 - 277) << 52) | (m << 29))
}

/// As abs_key32 for f64 sources: d * 2^(max(e, 1) - 1075), value (1.m) * 2^(E - 2098) for a
/// key with exponent field E (at most 3122, so it fits in u64).
#[inline(always)]
fn abs_key64(xa: u64, ya: u64, d: u64, d_float: f64) -> u64 {
    let e = xa >> 52;
    let key = d_float.to_bits().wrapping_add(e.max(1) << 52);
    if ya == 0 && e != 0 {
        xa.wrapping_add(1075 << 52)
    } else if d == 0 {
        0
    } else {
        key
    }
}

fn decode_abs64(key: u64) -> f64 {
    if key == 0 {
        return 0.0;
    }
    let (e, m) = ((key >> 52) as i64, key & 0x000F_FFFF_FFFF_FFFF);
    let biased = e - 2098 + 1023;
    if biased >= 1 {
        f64::from_bits(((biased as u64) << 52) | m)
    } else {
        // An error below 2^-1022 comes from an f64 subnormal input and is a multiple of
        // 2^-1074, so the shift drops only zeros.
        f64::from_bits((m | 1 << 52) >> (1 - biased))
    }
}

#[inline(always)]
fn measure32<const N: usize, const F16_OUT: bool, const SIGNED: bool>(
    src: &[u8],
    dst: &[u8],
    load: impl Fn([u8; N]) -> u32,
) -> Numerics {
    let (src, dst) = (src.as_chunks::<N>().0, dst.as_chunks::<2>().0);
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &dst[..n]);
    let mut t = Tally::<u32>::default();
    let (src_blocks, src_tail) = src.as_chunks::<BLOCK>();
    let (dst_blocks, dst_tail) = dst.as_chunks::<BLOCK>();
    for (s, d) in src_blocks.iter().zip(dst_blocks) {
        if !plain32::<N, F16_OUT, SIGNED>(s, d, &load, &mut t) {
            block32::<N, F16_OUT>(s, d, &load, &mut t);
        }
    }
    if !plain32::<N, F16_OUT, SIGNED>(src_tail, dst_tail, &load, &mut t) {
        block32::<N, F16_OUT>(src_tail, dst_tail, &load, &mut t);
    }
    Numerics {
        elements: t.elements,
        overflow: t.overflow,
        underflow_to_zero: t.underflow_to_zero,
        subnormal: t.subnormal,
        nan_in: t.nan_in,
        inf_in: t.inf_in,
        max_abs_error: decode_abs32(t.abs_key),
        max_rel_error: f64::from(f32::from_bits(t.rel_bits)),
    }
}

/// The common case, fast: a block whose non-zero inputs are at least 2^-102 and whose
/// errors are finite (a NaN or infinite input, or an overflow, makes an error NaN or
/// infinite). Every error is then zero or a normal f32, so |y - x| in f32 is exact whatever
/// the MXCSR flush bits (Sterbenz's lemma, or y = 0), and |y - x| / |x| is the same division
/// as in `block32`. Adds the block to `t` and returns true if it is such a block; else
/// returns false and leaves `t` alone.
#[inline(always)]
fn plain32<const N: usize, const F16_OUT: bool, const SIGNED: bool>(
    src: &[[u8; N]],
    dst: &[[u8; 2]],
    load: &impl Fn([u8; N]) -> u32,
    t: &mut Tally<u32>,
) -> bool {
    const LOW: u32 = 25 << 23;
    let tiny: u32 = if F16_OUT { 0x3880_0000 } else { 0x0080_0000 };
    // The smallest non-zero input minus one (0 wraps to the top).
    let mut low = u32::MAX;
    let (mut under, mut sub) = (0u32, 0u32);
    let (mut abs_bits, mut rel_bits) = (0u32, 0u32);
    for (s, d) in src.iter().zip(dst) {
        let x = load(*s);
        let xa = if SIGNED { x & 0x7FFF_FFFF } else { x };
        let o = u32::from(u16::from_le_bytes(*d)) & 0x7FFF;
        low = low.min(xa.wrapping_sub(1));
        if F16_OUT {
            // Only f16 has subnormal or zero results of inputs this large.
            under = under.wrapping_add(u32::from((xa != 0) & (o == 0)));
            sub = sub.wrapping_add(u32::from((o != 0) & (o < 0x0400)));
        }
        // Output and input share their sign: bf16 keeps it without masking.
        let (x, y) = if F16_OUT {
            (f32::from_bits(xa), f32::from_bits(widen_f16(o)))
        } else if SIGNED {
            let y = u32::from(u16::from_le_bytes(*d)) << 16;
            (f32::from_bits(x), f32::from_bits(y))
        } else {
            (f32::from_bits(xa), f32::from_bits(o << 16))
        };
        let err = (y - x).abs();
        abs_bits = abs_bits.max(err.to_bits());
        // A zero input has a zero error: dividing it by `tiny` keeps it 0, not NaN.
        let rel = (err / f32::from_bits(xa.max(tiny))).to_bits();
        rel_bits = rel_bits.max(if !F16_OUT || xa >= tiny { rel } else { 0 });
    }
    if low < LOW - 1 || abs_bits >= 0x7F80_0000 {
        return false;
    }
    t.elements += src.len().min(dst.len()) as u64;
    t.underflow_to_zero += u64::from(under);
    t.subnormal += u64::from(sub);
    // An error as f32 bits is a key whose exponent field is 150 less (see abs_key32).
    if abs_bits != 0 {
        t.abs_key = t.abs_key.max(abs_bits + (150 << 23));
    }
    t.rel_bits = t.rel_bits.max(rel_bits);
    true
}

/// One block of at most BLOCK elements, any values (the source as f32 bits from `load`).
#[inline(always)]
fn block32<const N: usize, const F16_OUT: bool>(
    src: &[[u8; N]],
    dst: &[[u8; 2]],
    load: &impl Fn([u8; N]) -> u32,
    t: &mut Tally<u32>,
) {
    let exp = exp_mask(F16_OUT);
    // The target's smallest normal, as f32 bits: 2^-14 or 2^-126.
    let tiny = if F16_OUT { 0x3880_0000 } else { 0x0080_0000 };
    let (mut nan, mut inf, mut over, mut under, mut sub) = (0u32, 0u32, 0u32, 0u32, 0u32);
    let (mut abs_key, mut rel_bits) = (0u32, 0u32);
    for (s, d) in src.iter().zip(dst) {
        let xa = load(*s) & 0x7FFF_FFFF;
        let o = u32::from(u16::from_le_bytes(*d)) & 0x7FFF;
        let x_finite = xa < 0x7F80_0000;
        let ok = x_finite & (o < exp);
        nan = nan.wrapping_add(u32::from(xa > 0x7F80_0000));
        inf = inf.wrapping_add(u32::from(xa == 0x7F80_0000));
        over = over.wrapping_add(u32::from(x_finite & (o == exp)));
        under = under.wrapping_add(u32::from((xa != 0) & (o == 0)));
        sub = sub.wrapping_add(u32::from((o != 0) & (o & exp == 0)));

        let ya = widen_out(o, F16_OUT);
        let d = xa.abs_diff(ya);
        // Exact: d < 2^24 wherever it is used (garbage elsewhere is masked off).
        let d_float = d as i32 as f32;
        let key = abs_key32(xa, ya, d, d_float);
        abs_key = abs_key.max(if ok { key } else { 0 });
        // The significand of x as an integer in [2^23, 2^24): exact.
        let significand = f32::from_bits(0x4B00_0000 | (xa & 0x7F_FFFF));
        let rel = (d_float / significand).to_bits();
        rel_bits = rel_bits.max(if ok & (xa >= tiny) { rel } else { 0 });
    }
    t.elements += src.len().min(dst.len()) as u64;
    t.nan_in += u64::from(nan);
    t.inf_in += u64::from(inf);
    t.overflow += u64::from(over);
    t.underflow_to_zero += u64::from(under);
    t.subnormal += u64::from(sub);
    t.abs_key = t.abs_key.max(abs_key);
    t.rel_bits = t.rel_bits.max(rel_bits);
}

#[inline(always)]
fn measure64<const F16_OUT: bool>(src: &[u8], dst: &[u8]) -> Numerics {
    let (src, dst) = (src.as_chunks::<8>().0, dst.as_chunks::<2>().0);
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &dst[..n]);
    let mut t = Tally::<u64>::default();
    let (src_blocks, src_tail) = src.as_chunks::<BLOCK>();
    let (dst_blocks, dst_tail) = dst.as_chunks::<BLOCK>();
    for (s, d) in src_blocks.iter().zip(dst_blocks) {
        if !plain64::<F16_OUT>(s, d, &mut t) {
            block64::<F16_OUT>(s, d, &mut t);
        }
    }
    if !plain64::<F16_OUT>(src_tail, dst_tail, &mut t) {
        block64::<F16_OUT>(src_tail, dst_tail, &mut t);
    }
    Numerics {
        elements: t.elements,
        overflow: t.overflow,
        underflow_to_zero: t.underflow_to_zero,
        subnormal: t.subnormal,
        nan_in: t.nan_in,
        inf_in: t.inf_in,
        max_abs_error: decode_abs64(t.abs_key),
        max_rel_error: f64::from_bits(t.rel_bits),
    }
}

/// 2^52 as f64: or-ing an integer below 2^52 into its mantissa and subtracting it converts
/// the integer exactly, with operations every ISA vectorises.
const TWO52: f64 = 4_503_599_627_370_496.0;
const TWO52_BITS: u64 = 0x4330_0000_0000_0000;

/// f64 bits of finite f32 magnitude bits, exact.
#[inline(always)]
fn f64_bits_of_f32(a: u32) -> u64 {
    let (e, m) = (u64::from(a >> 23), u64::from(a & 0x7F_FFFF));
    let normal = ((e + 896) << 52) | (m << 29);
    // m * 2^-149: the exact f64 of m, then exponent arithmetic (a normal result).
    let subnormal = (f64::from_bits(TWO52_BITS | m) - TWO52)
        .to_bits()
        .wrapping_sub(149 << 52);
    if e != 0 {
        normal
    } else if m == 0 {
        0
    } else {
        subnormal
    }
}

/// As `plain32`, for f64 sources: non-zero inputs at least 2^-102 and finite errors, so
/// that every output is zero or widens to a normal f32 and |y - x| in f64 is exact.
#[inline(always)]
fn plain64<const F16_OUT: bool>(src: &[[u8; 8]], dst: &[[u8; 2]], t: &mut Tally<u64>) -> bool {
    const LOW: u64 = (1023 - 102) << 52;
    let tiny: u64 = if F16_OUT { 1009 << 52 } else { 897 << 52 };
    let mut low = u64::MAX;
    let (mut under, mut sub) = (0u32, 0u32);
    let (mut abs_bits, mut rel_bits) = (0u64, 0u64);
    for (s, d) in src.iter().zip(dst) {
        let xa = u64::from_le_bytes(*s) & 0x7FFF_FFFF_FFFF_FFFF;
        let o = u32::from(u16::from_le_bytes(*d)) & 0x7FFF;
        low = low.min(xa.wrapping_sub(1));
        if F16_OUT {
            under = under.wrapping_add(u32::from((xa != 0) & (o == 0)));
            sub = sub.wrapping_add(u32::from((o != 0) & (o < 0x0400)));
        }
        let ya = widen_out(o, F16_OUT);
        let (e, m) = (u64::from(ya >> 23), u64::from(ya & 0x7F_FFFF));
        // Zero, or a normal f32; ±inf and NaN widen to an f64 infinity (error inf or NaN).
        let y = if ya == 0 {
            0
        } else if ya >= 0x7F80_0000 {
            0x7FF0_0000_0000_0000
        } else {
            ((e + 896) << 52) | (m << 29)
        };
        let err = (f64::from_bits(y) - f64::from_bits(xa)).abs();
        abs_bits = abs_bits.max(err.to_bits());
        let rel = (err / f64::from_bits(xa.max(tiny))).to_bits();
        rel_bits = rel_bits.max(if xa >= tiny { rel } else { 0 });
    }
    if low < LOW - 1 || abs_bits >= 0x7FF0_0000_0000_0000 {
        return false;
    }
    t.elements += src.len().min(dst.len()) as u64;
    t.underflow_to_zero += u64::from(under);
    t.subnormal += u64::from(sub);
    // An error as f64 bits is a key whose exponent field is 1075 less (see abs_key64).
    if abs_bits != 0 {
        t.abs_key = t.abs_key.max(abs_bits + (1075 << 52));
    }
    t.rel_bits = t.rel_bits.max(rel_bits);
    true
}

#[inline(always)]
fn block64<const F16_OUT: bool>(src: &[[u8; 8]], dst: &[[u8; 2]], t: &mut Tally<u64>) {
    let exp = exp_mask(F16_OUT);
    // The target's smallest normal as f64 bits: 2^-14 or 2^-126.
    let tiny: u64 = if F16_OUT { 1009 << 52 } else { 897 << 52 };
    let (mut nan, mut inf, mut over, mut under, mut sub) = (0u32, 0u32, 0u32, 0u32, 0u32);
    let (mut abs_key, mut rel_bits) = (0u64, 0u64);
    for (s, d) in src.iter().zip(dst) {
        let xa = u64::from_le_bytes(*s) & 0x7FFF_FFFF_FFFF_FFFF;
        let o = u32::from(u16::from_le_bytes(*d)) & 0x7FFF;
        let x_finite = xa < 0x7FF0_0000_0000_0000;
        let ok = x_finite & (o < exp);
        nan = nan.wrapping_add(u32::from(xa > 0x7FF0_0000_0000_0000));
        inf = inf.wrapping_add(u32::from(xa == 0x7FF0_0000_0000_0000));
        over = over.wrapping_add(u32::from(x_finite & (o == exp)));
        under = under.wrapping_add(u32::from((xa != 0) & (o == 0)));
        sub = sub.wrapping_add(u32::from((o != 0) & (o & exp == 0)));

        let ya = f64_bits_of_f32(widen_out(o, F16_OUT));
        let d = xa.abs_diff(ya);
        // Exact: d < 2^52 wherever it is used (garbage elsewhere is masked off).
        let d_float = f64::from_bits(TWO52_BITS | d) - TWO52;
        let key = abs_key64(xa, ya, d, d_float);
        abs_key = abs_key.max(if ok { key } else { 0 });
        let significand = f64::from_bits(TWO52_BITS | (xa & 0x000F_FFFF_FFFF_FFFF));
        let rel = (d_float / significand).to_bits();
        rel_bits = rel_bits.max(if ok & (xa >= tiny) { rel } else { 0 });
    }
    t.elements += src.len().min(dst.len()) as u64;
    t.nan_in += u64::from(nan);
    t.inf_in += u64::from(inf);
    t.overflow += u64::from(over);
    t.underflow_to_zero += u64::from(under);
    t.subnormal += u64::from(sub);
    t.abs_key = t.abs_key.max(abs_key);
    t.rel_bits = t.rel_bits.max(rel_bits);
}

#[cfg(test)]
mod tests {
    //! Against a plain reference: the values decoded independently, errors by f64 subtraction
    //! (exact here: Sterbenz's lemma, or y = 0).
    use super::*;
    use crate::kernels::{self, Isa};
    use Conversion::*;

    #[test]
    fn ranges_from_the_bits() {
        let bytes = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        // BF16: -2, 0.5, the smallest subnormal, +inf, NaN, -0.
        let r = Range::of(
            true,
            &bytes(&[0xC000, 0x3F00, 0x0001, 0x7F80, 0x7FC1, 0x8000]),
        );
        assert_eq!((r.elements, r.nan, r.inf), (6, 1, 1));
        assert_eq!((r.min, r.max), (Some(-2.0), Some(0.5)));
        let r = Range::of(true, &bytes(&[0x0001, 0x8000]));
        assert_eq!(r.max, Some(2f64.powi(-133)));
        assert_eq!(r.min.map(f64::to_bits), Some((-0.0f64).to_bits()));
        // F16: 65504, the smallest subnormal, -1.
        let mut r = Range::of(false, &bytes(&[0x7BFF, 0x0001, 0xBC00]));
        assert_eq!((r.min, r.max), (Some(-1.0), Some(65504.0)));
        let all_nan = Range::of(false, &bytes(&[0x7E00]));
        assert_eq!((all_nan.min, all_nan.max, all_nan.nan), (None, None, 1));
        r.merge(&all_nan);
        r.merge(&Range::of(false, &bytes(&[0x0001])));
        assert_eq!((r.elements, r.nan, r.min), (5, 1, Some(-1.0)));
        assert_eq!(
            Range::of(false, &bytes(&[0x0001])).max,
            Some(2f64.powi(-24))
        );
    }

    const SEED: u64 = 0x5EED_4E75;
    const ALL: [Conversion; 6] = [
        F32ToBf16, F16ToBf16, F64ToBf16, F32ToF16, F64ToF16, Bf16ToF16,
    ];

    use crate::testutil::Rng;

    fn src_size(c: Conversion) -> usize {
        c.src_size() as usize
    }

    fn is_f16_out(c: Conversion) -> bool {
        matches!(c, F32ToF16 | F64ToF16 | Bf16ToF16)
    }

    fn half_value(h: u64) -> f64 {
        let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
        let (e, m) = ((h >> 10) & 0x1F, (h & 0x3FF) as f64);
        match e {
            0 => sign * m * 2f64.powi(-24),
            31 if m == 0.0 => sign * f64::INFINITY,
            31 => f64::NAN,
            _ => sign * (1024.0 + m) * 2f64.powi(e as i32 - 25),
        }
    }

    fn src_value(c: Conversion, bits: u64) -> f64 {
        if c == Bf16ToF16 {
            return f64::from(f32::from_bits((bits as u32) << 16));
        }
        match src_size(c) {
            2 => half_value(bits),
            4 => f64::from(f32::from_bits(bits as u32)),
            _ => f64::from_bits(bits),
        }
    }

    fn out_value(c: Conversion, o: u16) -> f64 {
        if is_f16_out(c) {
            half_value(u64::from(o))
        } else {
            f64::from(f32::from_bits(u32::from(o) << 16))
        }
    }

    fn reference(c: Conversion, src: &[u64], out: &[u16]) -> Numerics {
        let tiny = if is_f16_out(c) {
            2f64.powi(-14)
        } else {
            2f64.powi(-126)
        };
        let mut n = Numerics::default();
        for (&s, &o) in src.iter().zip(out) {
            let (x, y) = (src_value(c, s), out_value(c, o));
            n.elements += 1;
            n.nan_in += u64::from(x.is_nan());
            n.inf_in += u64::from(x.is_infinite());
            n.overflow += u64::from(x.is_finite() && y.is_infinite());
            n.underflow_to_zero += u64::from(x != 0.0 && y == 0.0);
            n.subnormal += u64::from(y != 0.0 && y.abs() < tiny);
            if x.is_finite() && y.is_finite() {
                let err = (y - x).abs();
                n.max_abs_error = n.max_abs_error.max(err);
                if x.abs() >= tiny {
                    let rel = if src_size(c) == 8 {
                        err / x.abs()
                    } else {
                        f64::from(err as f32 / x.abs() as f32)
                    };
                    n.max_rel_error = n.max_rel_error.max(rel);
                }
            }
        }
        n
    }

    fn to_bytes(c: Conversion, src: &[u64]) -> Vec<u8> {
        let size = src_size(c);
        src.iter()
            .flat_map(|b| b.to_le_bytes()[..size].to_vec())
            .collect()
    }

    /// The kernel's output for `src` (element bits of the source width).
    fn convert(c: Conversion, src: &[u64]) -> (Vec<u8>, Vec<u8>) {
        let bytes = to_bytes(c, src);
        let mut out = vec![0u8; src.len() * 2];
        let kernel = match c {
            F32ToBf16 => kernels::f32_to_bf16,
            F16ToBf16 => kernels::f16_to_bf16,
            F64ToBf16 => kernels::f64_to_bf16,
            F32ToF16 => kernels::f32_to_f16,
            F64ToF16 => kernels::f64_to_f16,
            Bf16ToF16 => kernels::bf16_to_f16,
        };
        kernel(Isa::Scalar, &bytes, &mut out);
        (bytes, out)
    }

    fn out_bits(out: &[u8]) -> Vec<u16> {
        out.chunks(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    /// Every ISA measures what the reference says, whole and in merged pieces.
    fn check(c: Conversion, src: &[u64]) -> Numerics {
        let (bytes, out) = convert(c, src);
        let want = reference(c, src, &out_bits(&out));
        for isa in Isa::available() {
            assert_eq!(measure_with(isa, c, &bytes, &out), want, "{c:?} {isa:?}");
        }
        let cut = src.len() / 3;
        let size = src_size(c);
        let mut merged = measure(c, &bytes[..cut * size], &out[..cut * 2]);
        merged.merge(&measure(c, &bytes[cut * size..], &out[cut * 2..]));
        assert_eq!(merged, want, "{c:?} in two pieces");
        want
    }

    fn f32s(values: &[f32]) -> Vec<u64> {
        values.iter().map(|v| u64::from(v.to_bits())).collect()
    }

    fn f64s(values: &[f64]) -> Vec<u64> {
        values.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn counts_each_kind_f32_to_bf16() {
        let src = f32s(&[
            1.0,
            -2.5,
            f32::MAX,                 // overflow
            -3.4e38,                  // overflow (above bf16's largest, 0x7F7F)
            3.38e38,                  // rounds to bf16's largest: finite
            1e-45,                    // the smallest subnormal f32: underflow
            -f32::from_bits(1 << 15), // tie to even: -0, underflow
            f32::from_bits(1 << 19),  // a bf16 subnormal
            -f32::from_bits(1 << 16), // the smallest bf16 subnormal
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
        ]);
        let n = check(F32ToBf16, &src);
        assert_eq!(
            (
                n.elements,
                n.overflow,
                n.underflow_to_zero,
                n.subnormal,
                n.nan_in,
                n.inf_in
            ),
            (15, 2, 2, 2, 2, 2)
        );
    }

    #[test]
    fn counts_each_kind_f32_to_f16() {
        let src = f32s(&[
            65504.0,        // f16's largest
            65519.0,        // rounds down to it
            65520.0,        // overflow
            -1e10,          // overflow
            2f32.powi(-25), // tie to even: 0, underflow
            3e-8,           // 2^-24: subnormal
            1e-5,           // subnormal
            6.2e-5,         // 2^-14 rounds to the smallest normal
            1e-30,          // underflow
            f32::NAN,
            f32::INFINITY,
            1.0 / 3.0,
        ]);
        let n = check(F32ToF16, &src);
        assert_eq!(
            (
                n.elements,
                n.overflow,
                n.underflow_to_zero,
                n.subnormal,
                n.nan_in,
                n.inf_in
            ),
            (12, 2, 2, 2, 1, 1)
        );
    }

    #[test]
    fn counts_each_kind_f16_to_bf16() {
        // f16 -> bf16 neither overflows nor underflows; f16 subnormals are normal in bf16.
        let src: Vec<u64> = vec![
            0x3C00, 0x7BFF, 0x0001, 0x8200, 0x7C00, 0xFC00, 0x7E00, 0, 0x3C01,
        ];
        let n = check(F16ToBf16, &src);
        assert_eq!(
            (
                n.elements,
                n.overflow,
                n.underflow_to_zero,
                n.subnormal,
                n.nan_in,
                n.inf_in
            ),
            (9, 0, 0, 0, 1, 2)
        );
        // 1 + 2^-10 is 1 in bf16: off by 2^-10.
        assert_eq!(n.max_abs_error, 32.0); // 65504 -> 65536
        assert_eq!(
            n.max_rel_error,
            f64::from(2f32.powi(-10) / (1.0 + 2f32.powi(-10)))
        );
    }

    #[test]
    fn counts_each_kind_bf16_to_f16() {
        let src: Vec<u64> = vec![
            0x3F80, 0x477F, 0x4780, 0xC780, 0x3300, 0x3380, 0x7FC1, 0x7F80,
        ];
        let n = check(Bf16ToF16, &src);
        assert_eq!(
            (
                n.elements,
                n.overflow,
                n.underflow_to_zero,
                n.subnormal,
                n.nan_in,
                n.inf_in
            ),
            (8, 2, 1, 1, 1, 1)
        );
    }

    #[test]
    fn counts_each_kind_f64() {
        let values = [
            1.0,
            1.0 + 2f64.powi(-8) + 2f64.powi(-40), // rounds up (once, correctly)
            1e300,                                // overflow
            -1e39,                                // overflow for both targets
            1e-300,                               // underflow for both
            f64::MIN_POSITIVE / 4.0,              // an f64 subnormal: underflow
            2f64.powi(-130),                      // bf16 subnormal; f16 underflow
            1e-5,                                 // f16 subnormal, bf16 normal
            -f64::NAN,
            f64::INFINITY,
            0.0,
        ];
        let n = check(F64ToBf16, &f64s(&values));
        assert_eq!(
            (
                n.elements,
                n.overflow,
                n.underflow_to_zero,
                n.subnormal,
                n.nan_in,
                n.inf_in
            ),
            (11, 2, 2, 1, 1, 1)
        );
        let n = check(F64ToF16, &f64s(&values));
        assert_eq!(
            (
                n.elements,
                n.overflow,
                n.underflow_to_zero,
                n.subnormal,
                n.nan_in,
                n.inf_in
            ),
            (11, 2, 3, 1, 1, 1)
        );
    }

    #[test]
    fn max_errors_on_known_values() {
        // 1 + 2^-8 is a tie and goes to 1 (even): error 2^-8, relative 2^-8 / (1 + 2^-8).
        let n = check(F32ToBf16, &f32s(&[1.0 + 2f32.powi(-8), 0.5, -0.25]));
        assert_eq!(n.max_abs_error, 2f64.powi(-8));
        assert_eq!(
            n.max_rel_error,
            f64::from(2f32.powi(-8) / (1.0 + 2f32.powi(-8)))
        );
        // Errors far below f32's normal range are exact too.
        let n = check(F32ToBf16, &f32s(&[f32::from_bits(0x0000_FFFF)]));
        assert_eq!(n.max_abs_error, 2f64.powi(-149));
        assert_eq!((n.max_rel_error, n.subnormal), (0.0, 1));
        // An f64 subnormal that underflows: the error is the input, exactly.
        let tiny = f64::from_bits(3);
        let n = check(F64ToF16, &f64s(&[tiny]));
        assert_eq!((n.max_abs_error, n.underflow_to_zero), (tiny, 1));
        // Relative error only counts inputs at or above the target's smallest normal.
        let n = check(
            F32ToF16,
            &f32s(&[3e-8, 2f32.powi(-14) * (1.0 + 2f32.powi(-12))]),
        );
        assert_eq!(
            n.max_rel_error,
            f64::from(2f32.powi(-12) / (1.0 + 2f32.powi(-12)))
        );
        // A value that overflows has no error; 1e10 in f16 is inf.
        let n = check(F32ToF16, &f32s(&[1e10, 1.0]));
        assert_eq!(
            (n.max_abs_error, n.max_rel_error, n.overflow),
            (0.0, 0.0, 1)
        );
        // 1 + 2^-8 + 2^-40 in F64 -> BF16 is 1 + 2^-7: error 2^-8 - 2^-40.
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        let n = check(F64ToBf16, &f64s(&[x]));
        assert_eq!(n.max_abs_error, 2f64.powi(-8) - 2f64.powi(-40));
        assert_eq!(n.max_rel_error, (2f64.powi(-8) - 2f64.powi(-40)) / x);
    }

    #[test]
    fn nan_only_and_empty_tensors() {
        for c in ALL {
            let nan = match src_size(c) {
                2 if c == Bf16ToF16 => 0xFF81,
                2 => 0x7E01,
                4 => 0xFF80_0001,
                _ => 0x7FF8_0000_0000_0001,
            };
            let n = check(c, &vec![nan; 1000]);
            let want = Numerics {
                elements: 1000,
                nan_in: 1000,
                ..Numerics::default()
            };
            assert_eq!(n, want, "{c:?}");
            assert_eq!(measure(c, &[], &[]), Numerics::default(), "{c:?}");
        }
    }

    /// Ordinary values, zeros and, for f16, values that underflow or become subnormal:
    /// blocks that take the fast path (`plain32`), which must agree with the reference.
    #[test]
    fn plain_blocks_take_the_fast_path() {
        println!("seed {SEED:#x}");
        let mut rng = Rng(SEED ^ 3);
        for c in [F32ToBf16, F32ToF16, F64ToBf16, F64ToF16] {
            let src: Vec<u64> = (0..BLOCK * 3 + 100)
                .map(|i| {
                    let r = rng.next();
                    // Magnitudes 2^-101 .. 2^14, random signs, a zero every 10th.
                    let exp = 1023 - 101 + (r >> 40) % 115;
                    let x = f64::from_bits((r & 1 << 63) | (exp << 52) | (r & 0xF_FFFF_FFFF));
                    let x = if i % 10 == 0 { 0.0 } else { x };
                    match src_size(c) {
                        4 => u64::from((x as f32).to_bits()),
                        _ => x.to_bits(),
                    }
                })
                .collect();
            let n = check(c, &src);
            assert!(n.max_abs_error > 0.0 && n.max_rel_error > 0.0);
            if is_f16_out(c) {
                assert!(n.underflow_to_zero > 100 && n.subnormal > 100, "{n:?}");
            }
            let (bytes, out) = convert(c, &src);
            let d = &out.as_chunks::<2>().0[..BLOCK];
            let (s32, s64) = (&bytes.as_chunks::<4>().0, &bytes.as_chunks::<8>().0);
            let load = &u32::from_le_bytes;
            let plain = match c {
                F32ToBf16 => {
                    plain32::<4, false, true>(&s32[..BLOCK], d, load, &mut Tally::default())
                }
                F32ToF16 => plain32::<4, true, true>(&s32[..BLOCK], d, load, &mut Tally::default()),
                F64ToBf16 => plain64::<false>(&s64[..BLOCK], d, &mut Tally::default()),
                _ => plain64::<true>(&s64[..BLOCK], d, &mut Tally::default()),
            };
            assert!(plain, "{c:?}");
        }
    }

    /// Random bit patterns, values around each target's subnormal range and overflow
    /// threshold, and the specials, for every conversion and ISA.
    #[test]
    fn random_and_edge_values_match_the_reference() {
        println!("seed {SEED:#x}");
        let mut rng = Rng(SEED);
        for c in ALL {
            let mut src: Vec<u64> = Vec::new();
            for _ in 0..20_000 {
                let r = rng.next();
                src.push(match src_size(c) {
                    2 => r & 0xFFFF,
                    4 => r >> 32,
                    _ => r,
                });
            }
            // Log-uniform magnitudes from 2^-160 to 2^140 with random signs.
            for _ in 0..20_000 {
                let r = rng.next();
                let exp = (r >> 40) % 300;
                let x = f64::from_bits(((1023 - 160 + exp) << 52) | (r & 0xF_FFFF_FFFF_FFFF));
                let x = if r >> 63 == 1 { -x } else { x };
                src.push(match src_size(c) {
                    2 if c == Bf16ToF16 => u64::from(kernels::bf16_from_f32((x as f32).to_bits())),
                    2 => u64::from(kernels::f16_from_f32((x as f32).to_bits())),
                    4 => u64::from((x as f32).to_bits()),
                    _ => x.to_bits(),
                });
            }
            // Exhaustive for f16 sources.
            if src_size(c) == 2 {
                src.extend(0..=0xFFFF);
            }
            let n = check(c, &src);
            // BF16 -> F16 is exact at and above f16's smallest normal.
            assert!(n.max_rel_error > 0.0 || c == Bf16ToF16, "{c:?}");
            assert!(n.max_abs_error > 0.0, "{c:?}");
        }
    }

    /// Results with MXCSR flush-to-zero and denormals-are-zero on (as a library built with
    /// -ffast-math may leave them in a Python process) equal those computed before.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn measure_ignores_flush_to_zero_and_denormals_are_zero() {
        let mut rng = Rng(SEED ^ 7);
        let mut cases = Vec::new();
        for c in ALL {
            // Small magnitudes, where flushing would change errors.
            // Then values just above the fast path's lower bound, 2^-102.
            let plain = (0..5000).map(|_| {
                let r = rng.next();
                let x = f64::from_bits(((1023 - 102 + (r >> 40) % 40) << 52) | (r >> 12));
                match src_size(c) {
                    2 if c == Bf16ToF16 => u64::from(kernels::bf16_from_f32((x as f32).to_bits())),
                    2 => r & 0x7FFF,
                    4 => u64::from((x as f32).to_bits()) | (r & 0x8000_0000),
                    _ => x.to_bits(),
                }
            });
            let plain: Vec<u64> = plain.collect();
            let src: Vec<u64> = (0..5000)
                .map(|_| {
                    let r = rng.next();
                    let x = f64::from_bits(((1023 - 150 + (r >> 40) % 40) << 52) | (r >> 12));
                    match src_size(c) {
                        2 => r & 0x87FF,
                        4 => u64::from((x as f32).to_bits()) | (r & 0x8000_0000),
                        _ => x.to_bits(),
                    }
                })
                .chain(plain)
                .collect();
            let (bytes, out) = convert(c, &src);
            let want = reference(c, &src, &out_bits(&out));
            cases.push((c, bytes, out, want));
        }
        let got: Vec<Vec<Numerics>> = crate::testutil::with_ftz_daz(|| {
            cases
                .iter()
                .map(|(c, bytes, out, _)| {
                    Isa::available()
                        .into_iter()
                        .map(|isa| measure_with(isa, *c, bytes, out))
                        .collect()
                })
                .collect()
        });
        for ((c, _, _, want), got) in cases.iter().zip(got) {
            for n in got {
                assert_eq!(&n, want, "{c:?}");
            }
        }
    }
}
