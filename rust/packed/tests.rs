//! Packed-format tests: every code against every scale (and zero point) compared with a
//! reference written here the straightforward way (exact f64 arithmetic and one rounding
//! function, none of the kernels' code), and the fixtures written once by the real tools
//! (tests/fixtures/packed: llm-compressor's model_free_ptq, compressed-tensors' decompress,
//! transformers' convert_moe_packed_tensors).

use super::*;
use crate::testutil::Rng;

// ---- the reference --------------------------------------------------------------------

/// A binary floating-point format: significand bits (with the implicit one), the smallest
/// normal exponent, the largest exponent.
#[derive(Clone, Copy)]
struct Fmt(i32, i32, i32);

const F32: Fmt = Fmt(24, -126, 127);
const BF16: Fmt = Fmt(8, -126, 127);
const F16: Fmt = Fmt(11, -14, 15);

/// `x` rounded to `f`: to nearest, ties to even, with subnormals, overflow to infinity.
/// Every input here is a normal f64 (or zero, inf, NaN), and the scalings are exact.
fn rnd(x: f64, f: Fmt) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    let Fmt(p, emin, emax) = f;
    let e = (((x.to_bits() >> 52) & 0x7FF) as i32 - 1023).max(emin);
    let ulp = 2f64.powi(e - p + 1);
    let r = (x / ulp).round_ties_even() * ulp;
    let max = (2.0 - 2f64.powi(1 - p)) * 2f64.powi(emax);
    if r.abs() > max {
        f64::INFINITY.copysign(x)
    } else {
        r
    }
}

fn fmt_of(d: Dtype) -> Fmt {
    match d {
        Dtype::F32 => F32,
        Dtype::BF16 => BF16,
        Dtype::F16 => F16,
        _ => unreachable!(),
    }
}

/// The value of E2M1 code `c`: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0.
fn e2m1_ref(c: u8) -> f64 {
    let (e, m) = (i32::from((c >> 1) & 3), f64::from(c & 1));
    let v = if e == 0 {
        m * 0.5
    } else {
        (1.0 + m / 2.0) * 2f64.powi(e - 1)
    };
    if c & 8 != 0 {
        -v
    } else {
        v
    }
}

/// The value of E4M3FN byte `b`: sign bit 7, 4 exponent bits (bias 7), 3 mantissa bits;
/// `S.1111.111` is NaN, there is no infinity.
fn e4m3_ref(b: u8) -> f64 {
    let (e, m) = (i32::from((b >> 3) & 15), f64::from(b & 7));
    let v = if e == 15 && m == 7.0 {
        f64::NAN
    } else if e == 0 {
        m * 2f64.powi(-9)
    } else {
        (8.0 + m) * 2f64.powi(e - 10)
    };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// The value of F16 bits.
fn f16_ref(h: u16) -> f64 {
    let (e, m) = (i32::from((h >> 10) & 31), f64::from(h & 0x3FF));
    let v = match e {
        0 => m * 2f64.powi(-24),
        31 if m == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        _ => (1024.0 + m) * 2f64.powi(e - 25),
    };
    if h & 0x8000 != 0 {
        -v
    } else {
        v
    }
}

/// Little-endian bytes of `v`, exactly a value of `d`.
fn encode(d: Dtype, v: f64) -> Vec<u8> {
    match d {
        Dtype::F32 => (v as f32).to_le_bytes().to_vec(),
        Dtype::BF16 => (((v as f32).to_bits() >> 16) as u16).to_le_bytes().to_vec(),
        Dtype::F16 => {
            let sign = if v.is_sign_negative() { 0x8000u16 } else { 0 };
            let a = v.abs();
            let h = if a.is_infinite() {
                0x7C00
            } else if a < 2f64.powi(-14) {
                (a * 2f64.powi(24)) as u16
            } else {
                let e = ((a.to_bits() >> 52) & 0x7FF) as i32 - 1023;
                let m = (a / 2f64.powi(e) - 1.0) * 1024.0;
                (((e + 15) as u16) << 10) | m as u16
            };
            assert_eq!(f16_ref(sign | h), v, "{v} is an f16 value");
            (sign | h).to_le_bytes().to_vec()
        }
        _ => unreachable!(),
    }
}

/// The value of output element `i` of `dst` (target `t`).
fn value_at(t: Dtype, dst: &[u8], i: usize) -> f64 {
    let h = u16::from_le_bytes([dst[2 * i], dst[2 * i + 1]]);
    match t {
        Dtype::BF16 => f64::from(f32::from_bits(u32::from(h) << 16)),
        _ => f16_ref(h),
    }
}

/// Equal values, zeros of the same sign, or both NaN (NaN payloads are not compared).
fn same(a: f64, b: f64) -> bool {
    (a.is_nan() && b.is_nan()) || (a == b && a.is_sign_negative() == b.is_sign_negative())
}

fn check(what: &str, t: Dtype, dst: &[u8], want: &[f64]) {
    assert_eq!(dst.len(), 2 * want.len(), "{what}");
    let bad: Vec<_> = (0..want.len())
        .filter(|&i| !same(value_at(t, dst, i), want[i]))
        .collect();
    assert!(
        bad.is_empty(),
        "{what} {t:?}: {} of {} differ, first at {}: got {} want {}",
        bad.len(),
        want.len(),
        bad[0],
        value_at(t, dst, bad[0]),
        want[bad[0]]
    );
}

const TARGETS: [Dtype; 2] = [Dtype::BF16, Dtype::F16];

/// Rows of 16 codes (0..15, low nibble first), `per_row` runs of them per row.
fn all_codes_packed(rows: usize, per_row: usize) -> Vec<u8> {
    let run: Vec<u8> = (0..8u8).map(|j| (2 * j) | ((2 * j + 1) << 4)).collect();
    run.repeat(rows * per_row)
}

// ---- every code x every scale ---------------------------------------------------------

#[test]
fn e2m1_and_e8m0_tables() {
    for c in 0..16u8 {
        assert!(same(f64::from(E2M1[usize::from(c)]), e2m1_ref(c)), "{c}");
    }
    for b in 0..=255u8 {
        let want = rnd(2f64.powi(i32::from(b) - 127), F32);
        assert!(same(f64::from(e8m0(b)), want), "{b}");
    }
}

#[test]
fn nvfp4_every_code_every_scale() {
    // Row r: codes 0..15, E4M3 scale byte r.
    let packed = all_codes_packed(256, 1);
    let scales: Vec<u8> = (0..=255).collect();
    let globals = [
        1.0f32,
        0.088_867_19,
        448.0 * 6.0 / 0.37,
        3.0e-3,
        2f32.powi(-140),
        3.0e38,
        0.0,
        -2.5,
    ];
    for g in globals {
        for t in TARGETS {
            for scalar in [false, true] {
                let gs = if scalar {
                    GlobalScale::Scalar(g)
                } else {
                    GlobalScale::Tensor(g)
                };
                let mut dst = vec![0u8; 256 * 16 * 2];
                nvfp4(16, &packed, &scales, gs, t, &mut dst);
                let want: Vec<f64> = (0..256 * 16)
                    .map(|i| {
                        let (s, v) = (e4m3_ref(scales[i / 16]), e2m1_ref((i % 16) as u8));
                        let g = f64::from(g);
                        let out = if scalar {
                            let s2 = rnd(rnd(s / g, F32), BF16);
                            rnd(rnd(v * s2, F32), BF16)
                        } else {
                            rnd(rnd(v * rnd(s / g, F32), F32), BF16)
                        };
                        if t == Dtype::F16 {
                            rnd(out, F16)
                        } else {
                            out
                        }
                    })
                    .collect();
                check(&format!("nvfp4 g={g} scalar={scalar}"), t, &dst, &want);
            }
        }
    }
}

#[test]
fn mxfp4_every_code_every_scale() {
    // Row r: codes 0..15 twice, E8M0 byte r.
    let packed = all_codes_packed(256, 2);
    let scales: Vec<u8> = (0..=255).collect();
    for t in TARGETS {
        let mut dst = vec![0u8; 256 * 32 * 2];
        mxfp4(32, &packed, &scales, t, &mut dst);
        let want: Vec<f64> = (0..256 * 32)
            .map(|i| {
                let s = rnd(2f64.powi(scales[i / 32] as i32 - 127), BF16);
                let out = rnd(rnd(e2m1_ref((i % 16) as u8) * s, F32), BF16);
                if t == Dtype::F16 {
                    rnd(out, F16)
                } else {
                    out
                }
            })
            .collect();
        check("mxfp4", t, &dst, &want);
    }
}

#[test]
fn gptoss_every_code_every_scale() {
    let blocks = all_codes_packed(256, 2);
    let scales: Vec<u8> = (0..=255).collect();
    for t in TARGETS {
        let want: Vec<f64> = (0..256 * 32)
            .map(|i| {
                // The exact product, rounded once (2^128 for byte 255: 0 stays 0).
                let s = 2f64.powi(scales[i / 32] as i32 - 127);
                rnd(e2m1_ref((i % 16) as u8) * s, fmt_of(t))
            })
            .collect();
        let mut dst = vec![0u8; 256 * 32 * 2];
        gptoss(&blocks, &scales, t, &mut dst);
        check("gptoss", t, &dst, &want);
        // The transposed layout, 256 rows of one group: out[c][r] = rows' [r][c]; and the
        // same through windows of groups of a 4-group expert.
        let mut tr = vec![0u8; 256 * 32 * 2];
        gptoss_transposed(256, 1, &blocks, &scales, t, &mut tr);
        let want_t: Vec<f64> = (0..32 * 256)
            .map(|i| want[(i % 256) * 32 + i / 256])
            .collect();
        check("gptoss transposed", t, &tr, &want_t);
        let (rows, groups) = (64, 4);
        let mut one = vec![0u8; rows * groups * 64];
        gptoss_transposed(rows, groups, &blocks, &scales, t, &mut one);
        let mut windowed = vec![0u8; rows * groups * 64];
        for g in 0..groups {
            let b: Vec<u8> = (0..rows)
                .flat_map(|r| blocks[(r * groups + g) * 16..][..16].to_vec())
                .collect();
            let s: Vec<u8> = (0..rows).map(|r| scales[r * groups + g]).collect();
            let w = rows * 64;
            gptoss_transposed(rows, 1, &b, &s, t, &mut windowed[g * w..(g + 1) * w]);
        }
        assert_eq!(one, windowed);
    }
}

/// Codes (stored offset by 2^(bits-1)) densely packed, `bits` each, into LE I32 words:
/// a bit accumulator, not the kernel's field extraction.
fn pack_row(codes: &[i32], bits: u32) -> Vec<u8> {
    let n_words = (codes.len() * bits as usize).div_ceil(32);
    let mut words = vec![0u64; n_words + 1];
    for (i, &c) in codes.iter().enumerate() {
        let v = (c + (1 << (bits - 1))) as u64;
        assert!(v < 1 << bits);
        let p = i * bits as usize;
        words[p / 32] |= v << (p % 32);
    }
    // Carry the bits past each word's 32 into the next.
    let mut out = vec![0u32; n_words + 1];
    for k in 0..n_words {
        out[k] |= words[k] as u32;
        out[k + 1] |= (words[k] >> 32) as u32;
    }
    out[..n_words]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect()
}

/// Zero points `[rows, groups]` packed along rows: `[ceil(rows*bits/32), groups]`.
fn pack_columns(zp: &[i32], rows: usize, groups: usize, bits: u32) -> Vec<u8> {
    let cols: Vec<Vec<u8>> = (0..groups)
        .map(|g| {
            pack_row(
                &(0..rows).map(|r| zp[r * groups + g]).collect::<Vec<_>>(),
                bits,
            )
        })
        .collect();
    let n = cols[0].len() / 4;
    let mut out = Vec::new();
    for k in 0..n {
        for col in &cols {
            out.extend_from_slice(&col[4 * k..4 * k + 4]);
        }
    }
    out
}

/// Scales of dtype `d`: edge values, then magnitudes spread over the format's range.
fn scale_values(d: Dtype, n: usize, rng: &mut Rng) -> Vec<f64> {
    let Fmt(p, emin, emax) = fmt_of(d);
    let mut v = vec![
        2f64.powi(emin - p + 1),
        2f64.powi(emin),
        1.0,
        (2.0 - 2f64.powi(1 - p)) * 2f64.powi(emax),
        1.0 + 2f64.powi(1 - p),
        -0.75,
        0.0,
    ];
    while v.len() < n {
        let e = rng.below((emax - emin + p) as u64) as i32 + emin - p + 1;
        let m = 1.0 + rng.below(1 << 20) as f64 / f64::from(1 << 20);
        v.push(rnd(m * 2f64.powi(e), fmt_of(d)));
    }
    v.truncate(n);
    v
}

#[test]
fn int_every_code_every_zero_point() {
    let mut rng = Rng(32);
    for bits in [4u32, 8] {
        let n = 1usize << bits;
        let lo = -(n as i32 / 2);
        // rows x (groups of n columns): every group holds every code; zero point of
        // (row, group) = (row + group) mod n, offset: every code meets every zero point.
        let (rows, groups) = (n, if bits == 8 { 2 } else { 8 });
        let cols = n * groups;
        let codes: Vec<i32> = (0..rows * cols).map(|i| (i % n) as i32 + lo).collect();
        let zp: Vec<i32> = (0..rows * groups)
            .map(|i| ((i / groups + i % groups) % n) as i32 + lo)
            .collect();
        let words: Vec<u8> = codes.chunks(cols).flat_map(|r| pack_row(r, bits)).collect();
        let zpp = pack_columns(&zp, rows, groups, bits);
        let zp8: Vec<u8> = zp.iter().map(|&z| z as i8 as u8).collect();
        let i8s: Vec<u8> = codes.iter().map(|&c| c as i8 as u8).collect();
        for s_d in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            let sv = scale_values(s_d, rows * groups, &mut rng);
            let sb: Vec<u8> = sv.iter().flat_map(|&v| encode(s_d, v)).collect();
            for t in TARGETS {
                let want = |asym: bool| -> Vec<f64> {
                    (0..rows * cols)
                        .map(|i| {
                            let k = (i / cols) * groups + (i % cols) / n;
                            let x = f64::from(codes[i]) - if asym { f64::from(zp[k]) } else { 0.0 };
                            let x = rnd(x, fmt_of(s_d));
                            rnd(rnd(rnd(x * sv[k], F32), fmt_of(s_d)), fmt_of(t))
                        })
                        .collect()
                };
                let run = |codes: Codes, z: Option<ZeroPoints>, rows_per: usize| {
                    let mut dst = vec![0u8; rows * cols * 2];
                    for r0 in (0..rows).step_by(rows_per) {
                        let r1 = (r0 + rows_per).min(rows);
                        let c = match codes {
                            Codes::Packed { bits, words } => {
                                let w = words.len() / rows;
                                Codes::Packed {
                                    bits,
                                    words: &words[r0 * w..r1 * w],
                                }
                            }
                            Codes::I8(b) => Codes::I8(&b[r0 * cols..r1 * cols]),
                        };
                        let d = &mut dst[r0 * cols * 2..r1 * cols * 2];
                        int(IntLayout::Group(n), cols, r0, c, s_d, &sb, z, t, d);
                    }
                    dst
                };
                let packed = Codes::Packed {
                    bits,
                    words: &words,
                };
                let zpr = ZeroPoints::PackedRows {
                    bits,
                    groups,
                    data: &zpp,
                };
                let what = format!("int{bits} S={s_d:?}");
                check(
                    &format!("{what} asym"),
                    t,
                    &run(packed, Some(zpr), rows),
                    &want(true),
                );
                // Windows of 3 rows: the same.
                check(
                    &format!("{what} asym/3"),
                    t,
                    &run(packed, Some(zpr), 3),
                    &want(true),
                );
                check(
                    &format!("{what} sym"),
                    t,
                    &run(packed, None, 5),
                    &want(false),
                );
                if bits == 8 {
                    let z = Some(ZeroPoints::I8(&zp8));
                    check(
                        &format!("{what} i8 asym"),
                        t,
                        &run(Codes::I8(&i8s), z, 7),
                        &want(true),
                    );
                }
            }
        }
    }
}

#[test]
fn int_layouts_and_every_width() {
    // Every width 1..=8 (fields spanning two words for 3, 5, 6, 7), a row width that leaves
    // the last word partial, per channel and per tensor: codes come back exactly.
    let mut rng = Rng(7);
    for bits in 1..=8u32 {
        let (rows, cols) = (5, 37);
        let n = 1i32 << bits;
        let codes: Vec<i32> = (0..rows * cols)
            .map(|_| rng.below(n as u64) as i32 - n / 2)
            .collect();
        let words: Vec<u8> = codes.chunks(cols).flat_map(|r| pack_row(r, bits)).collect();
        let scales: Vec<u8> = (1..=rows).flat_map(|r| (r as f32).to_le_bytes()).collect();
        for layout in [IntLayout::Channel, IntLayout::Tensor] {
            let mut dst = vec![0u8; rows * cols * 2];
            let c = Codes::Packed {
                bits,
                words: &words,
            };
            int(
                layout,
                cols,
                0,
                c,
                Dtype::F32,
                &scales,
                None,
                Dtype::BF16,
                &mut dst,
            );
            let want: Vec<f64> = (0..rows * cols)
                .map(|i| {
                    let s = if layout == IntLayout::Tensor {
                        1
                    } else {
                        i / cols + 1
                    };
                    rnd(f64::from(codes[i]) * s as f64, BF16)
                })
                .collect();
            check(&format!("bits {bits} {layout:?}"), Dtype::BF16, &dst, &want);
        }
    }
    // Nothing written for what is not a layout; NaN for a missing scale, never a panic.
    let mut dst = vec![0xAAu8; 8];
    let c = Codes::I8(&[1, 2, 3, 4]);
    int(
        IntLayout::Group(3),
        4,
        0,
        c,
        Dtype::F32,
        &[0; 8],
        None,
        Dtype::BF16,
        &mut dst,
    );
    int(
        IntLayout::Channel,
        4,
        0,
        c,
        Dtype::I32,
        &[0; 4],
        None,
        Dtype::BF16,
        &mut dst,
    );
    int(
        IntLayout::Channel,
        4,
        0,
        c,
        Dtype::F32,
        &[0; 4],
        None,
        Dtype::F32,
        &mut dst,
    );
    assert_eq!(dst, [0xAA; 8]);
    int(
        IntLayout::Channel,
        4,
        9,
        c,
        Dtype::F32,
        &[0; 4],
        None,
        Dtype::BF16,
        &mut dst,
    );
    assert!((0..4).all(|i| value_at(Dtype::BF16, &dst, i).is_nan()));
    // A row far past any scale or zero point (a corrupt shape): NaN, no overflow.
    let z = Some(ZeroPoints::PackedRows {
        bits: 8,
        groups: 2,
        data: &[0; 8],
    });
    let far = usize::MAX - 1;
    let (g2, f32_, bf) = (IntLayout::Group(2), Dtype::F32, Dtype::BF16);
    int(g2, 4, far, c, f32_, &[0; 8], z, bf, &mut dst);
    assert!((0..4).all(|i| value_at(Dtype::BF16, &dst, i).is_nan()));
}

// ---- the fixtures ---------------------------------------------------------------------

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/packed");

fn read(path: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}/{path}")).unwrap()
}

type Tensors<'a> = std::collections::BTreeMap<String, safetensors::tensor::TensorView<'a>>;

fn tensors(bytes: &[u8]) -> Tensors<'_> {
    safetensors::SafeTensors::deserialize(bytes)
        .unwrap()
        .tensors()
        .into_iter()
        .collect()
}

/// How a compressed-tensors module is dequantized.
#[derive(Clone, Copy)]
enum Scheme {
    Nvfp4,
    Mxfp4,
    Int { bits: u32, group: Option<usize> },
}

/// Module `m` of `t` to `target`, in windows of `window` rows.
fn dequant(t: &Tensors, m: &str, scheme: Scheme, target: Dtype, window: usize) -> Vec<u8> {
    let get = |n: &str| t.get(&format!("{m}.{n}"));
    let packed = get("weight_packed").unwrap();
    let scale = get("weight_scale").unwrap();
    let rows = packed.shape()[0];
    let mut dst;
    match scheme {
        Scheme::Nvfp4 | Scheme::Mxfp4 => {
            let cols = packed.shape()[1] * 2;
            let g = scale.shape()[1];
            dst = vec![0u8; rows * cols * 2];
            for r0 in (0..rows).step_by(window) {
                let r1 = (r0 + window).min(rows);
                let p = &packed.data()[r0 * cols / 2..r1 * cols / 2];
                let s = &scale.data()[r0 * g..r1 * g];
                let d = &mut dst[r0 * cols * 2..r1 * cols * 2];
                if let Scheme::Nvfp4 = scheme {
                    let gs = get("weight_global_scale").unwrap();
                    let v = f32::from_le_bytes(gs.data()[..4].try_into().unwrap());
                    let gs = if gs.shape().is_empty() {
                        GlobalScale::Scalar(v)
                    } else {
                        GlobalScale::Tensor(v)
                    };
                    nvfp4(cols, p, s, gs, target, d);
                } else {
                    mxfp4(cols, p, s, target, d);
                }
            }
        }
        Scheme::Int { bits, group } => {
            let shape = get("weight_shape").unwrap();
            assert_eq!(shape.dtype(), Dtype::I64);
            let dims: Vec<usize> = shape
                .data()
                .chunks(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as usize)
                .collect();
            let cols = dims[1];
            assert_eq!(dims[0], rows);
            let groups = scale.shape()[1];
            let layout = match group {
                Some(g) if groups > 1 => IntLayout::Group(g),
                _ => IntLayout::Channel,
            };
            let zp = get("weight_zero_point").map(|z| ZeroPoints::PackedRows {
                bits,
                groups,
                data: z.data(),
            });
            let w = packed.shape()[1] * 4;
            dst = vec![0u8; rows * cols * 2];
            for r0 in (0..rows).step_by(window) {
                let r1 = (r0 + window).min(rows);
                let c = Codes::Packed {
                    bits,
                    words: &packed.data()[r0 * w..r1 * w],
                };
                let d = &mut dst[r0 * cols * 2..r1 * cols * 2];
                int(
                    layout,
                    cols,
                    r0,
                    c,
                    scale.dtype(),
                    scale.data(),
                    zp,
                    target,
                    d,
                );
            }
        }
    }
    dst
}

fn target_name(t: Dtype) -> &'static str {
    if t == Dtype::BF16 {
        "bf16"
    } else {
        "fp16"
    }
}

#[test]
fn codes_fixture_equals_the_real_tools() {
    let src = read("codes.safetensors");
    let exp = read("codes-expected.safetensors");
    let (src, exp) = (tensors(&src), tensors(&exp));
    let modules: std::collections::BTreeSet<&str> = src
        .keys()
        .filter_map(|k| k.strip_suffix(".weight_packed"))
        .collect();
    assert_eq!(modules.len(), 18);
    for m in modules {
        let scheme = if m.starts_with("nvfp4") {
            Scheme::Nvfp4
        } else if m.starts_with("mxfp4") {
            Scheme::Mxfp4
        } else {
            let bits = if m.starts_with("int4") { 4 } else { 8 };
            let group = if m.contains("group") {
                Some(if bits == 4 { 16 } else { 32 })
            } else {
                None
            };
            Scheme::Int { bits, group }
        };
        for t in TARGETS {
            let got = dequant(&src, m, scheme, t, 3);
            let want = &exp[&format!("{m}.weight.{}", target_name(t))];
            assert_eq!(want.dtype(), t);
            let want: Vec<f64> = (0..want.data().len() / 2)
                .map(|i| value_at(t, want.data(), i))
                .collect();
            check(m, t, &got, &want);
        }
    }
    let blocks = &src["gptoss.experts.down_proj_blocks"];
    let scales = &src["gptoss.experts.down_proj_scales"];
    assert_eq!(blocks.shape(), [1, 256, 1, 16]);
    for t in TARGETS {
        let mut got = vec![0u8; 256 * 32 * 2];
        gptoss_transposed(256, 1, blocks.data(), scales.data(), t, &mut got);
        let want = &exp[&format!("gptoss.experts.down_proj.{}", target_name(t))];
        assert_eq!(want.shape(), [1, 32, 256]);
        let want: Vec<f64> = (0..256 * 32).map(|i| value_at(t, want.data(), i)).collect();
        check("gptoss", t, &got, &want);
    }
}

/// The expected sha256 of every tensor of folder `f` for target `t`.
fn expected(json: &serde_json::Value, f: &str, t: Dtype) -> Vec<(String, String)> {
    json["folders"][f][target_name(t)]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v["sha256"].as_str().unwrap().to_string()))
        .collect()
}

/// A BF16 tensor not quantized, as the reference's `.to(target)` leaves it.
fn cast_bf16(data: &[u8], t: Dtype) -> Vec<u8> {
    data.chunks(2)
        .flat_map(|c| {
            let b = u16::from_le_bytes([c[0], c[1]]);
            if t == Dtype::BF16 {
                b
            } else {
                f16_from_bf16(b)
            }
            .to_le_bytes()
        })
        .collect()
}

#[test]
fn model_free_ptq_folders_equal_compressed_tensors() {
    let json: serde_json::Value = serde_json::from_slice(&read("expected-dequant.json")).unwrap();
    for (folder, scheme) in [
        ("llama-bf16.nvfp4a16", Scheme::Nvfp4),
        ("llama-bf16.mxfp4a16", Scheme::Mxfp4),
        (
            "llama-bf16.w4a16",
            Scheme::Int {
                bits: 4,
                group: Some(128),
            },
        ),
        (
            "llama-bf16.w4a16-asym",
            Scheme::Int {
                bits: 4,
                group: Some(128),
            },
        ),
        (
            "llama-bf16.w8a16",
            Scheme::Int {
                bits: 8,
                group: Some(128),
            },
        ),
    ] {
        let cfg: serde_json::Value =
            serde_json::from_slice(&read(&format!("{folder}/config.json"))).unwrap();
        let w = &cfg["quantization_config"]["config_groups"]
            .as_object()
            .unwrap()
            .values()
            .next()
            .unwrap()["weights"];
        if let Scheme::Int { bits, group } = scheme {
            assert_eq!(w["num_bits"], bits);
            assert_eq!(w["group_size"].as_u64().map(|g| g as usize), group);
        }
        let bytes = read(&format!("{folder}/model.safetensors"));
        let t = tensors(&bytes);
        for target in TARGETS {
            let want = expected(&json, folder, target);
            assert_eq!(want.len(), 12, "{folder}");
            for (name, sha) in want {
                let got = match name.strip_suffix(".weight") {
                    Some(m) if t.contains_key(&format!("{m}.weight_packed")) => {
                        dequant(&t, m, scheme, target, 7)
                    }
                    _ => {
                        assert_eq!(t[&name].dtype(), Dtype::BF16, "{name}");
                        cast_bf16(t[&name].data(), target)
                    }
                };
                let got = crate::text::sha256_hex(&got);
                assert_eq!(got, sha, "{folder} {name} {target:?}");
            }
        }
    }
}

#[test]
fn gpt_oss_folder_equals_transformers() {
    let json: serde_json::Value = serde_json::from_slice(&read("expected-dequant.json")).unwrap();
    let bytes = read("gpt-oss-mxfp4/model.safetensors");
    let t = tensors(&bytes);
    for target in TARGETS {
        let want = expected(&json, "gpt-oss-mxfp4", target);
        assert_eq!(want.len(), 5);
        for (name, sha) in want {
            let got = if let Some(b) = t.get(&format!("{name}_blocks")) {
                let s = &t[&format!("{name}_scales")];
                let [e, rows, groups, 16] = b.shape()[..] else {
                    panic!("{name}")
                };
                let per = rows * groups;
                let mut out = vec![0u8; e * per * 64];
                for x in 0..e {
                    gptoss_transposed(
                        rows,
                        groups,
                        &b.data()[x * per * 16..(x + 1) * per * 16],
                        &s.data()[x * per..(x + 1) * per],
                        target,
                        &mut out[x * per * 64..(x + 1) * per * 64],
                    );
                }
                out
            } else {
                cast_bf16(t[&name].data(), target)
            };
            assert_eq!(crate::text::sha256_hex(&got), sha, "{name} {target:?}");
        }
    }
}
