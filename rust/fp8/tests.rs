//! FP8 tests: torch's own vectors (tests/data/fp8-kernel-vectors.json, written by
//! tests/data/make_fp8_kernel_vectors.py from real torch 2.14 + llm-compressor runs), an
//! obviously-correct reference for the cast, straightforward references for the groups,
//! and the edge groups. Every fixture weight end to end: tests/test_fp8.py.
use super::*;
use crate::testutil::Rng;
use serde_json::Value;

const VECTORS: &str = include_str!("../../tests/data/fp8-kernel-vectors.json");

fn vectors() -> Value {
    serde_json::from_str(VECTORS).expect("vectors parse")
}

fn hex_bytes(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

fn hex_u32(s: &str) -> u32 {
    u32::from_str_radix(s, 16).expect("hex")
}

/// Hex words of `width` digits, concatenated.
fn hex_words(s: &str, width: usize) -> Vec<u32> {
    (0..s.len() / width)
        .map(|i| hex_u32(&s[i * width..(i + 1) * width]))
        .collect()
}

fn dtype_of(name: &str) -> Dtype {
    match name {
        "f32" | "F32" => Dtype::F32,
        "bf16" | "BF16" => Dtype::BF16,
        "f16" | "F16" => Dtype::F16,
        _ => panic!("dtype {name}"),
    }
}

/// Little-endian bytes of elements given as bits (`d`'s width).
fn le_bytes(d: Dtype, bits: &[u32]) -> Vec<u8> {
    bits.iter()
        .flat_map(|&b| match d {
            Dtype::F32 => b.to_le_bytes().to_vec(),
            _ => (b as u16).to_le_bytes().to_vec(),
        })
        .collect()
}

/// f32 of an element of `d` given as bits.
fn widen(d: Dtype, b: u32) -> f32 {
    match d {
        Dtype::F32 => f32::from_bits(b),
        Dtype::BF16 => f32::from_bits(b << 16),
        _ => f32::from_bits(f32_from_f16(b as u16)),
    }
}

/// The f32 of each scale in `bytes` (little-endian `d`).
fn scales_f32(d: Dtype, bytes: &[u8]) -> Vec<f32> {
    let size = if d == Dtype::F32 { 4 } else { 2 };
    bytes
        .chunks_exact(size)
        .map(|c| {
            let b = if size == 4 {
                u32::from_le_bytes([c[0], c[1], c[2], c[3]])
            } else {
                u32::from(u16::from_le_bytes([c[0], c[1]]))
            };
            widen(d, b)
        })
        .collect()
}

// ---- the cast -------------------------------------------------------------------------

/// The obviously-correct cast: the nearest of the 127 finite non-negative e4m3 values in
/// f64 (an exact comparison: every f32 and every e4m3 value and midpoint is exact in f64),
/// ties to the even code; above 448 (and inf) 448; NaN 0x7F; the sign put back.
fn e4m3_reference(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = f64::from(x.abs());
    if a >= 448.0 {
        return sign | 0x7E;
    }
    let values: Vec<f64> = (0..=0x7Eu8).map(|c| f64::from(e4m3_to_f32(c))).collect();
    // The first value >= a; its lower neighbour is the other candidate.
    let hi = values.partition_point(|&v| v < a);
    let best = if values[hi] == a || hi == 0 {
        hi
    } else {
        let (dl, dh) = (a - values[hi - 1], values[hi] - a);
        if dl < dh || (dl == dh && (hi - 1) % 2 == 0) {
            hi - 1
        } else {
            hi
        }
    };
    sign | best as u8
}

#[test]
fn codes_match_torch() {
    let v = vectors();
    let codes = v["codes"].as_array().expect("codes");
    assert_eq!(codes.len(), 256);
    for (b, c) in codes.iter().enumerate() {
        let want = hex_u32(c.as_str().expect("str"));
        assert_eq!(e4m3_to_f32(b as u8).to_bits(), want, "code {b:02x}");
        if b & 0x7F != 0x7F {
            assert_eq!(
                e4m3_value(b as u8).to_bits(),
                want,
                "branch-free decode {b:02x}"
            );
        }
    }
}

#[test]
fn every_code_round_trips() {
    for b in 0..=255u8 {
        let x = e4m3_to_f32(b);
        assert_eq!(e4m3_from_f32(x), b, "code {b:02x} ({x})");
        assert_eq!(e4m3_reference(x), b, "reference, code {b:02x}");
    }
    assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
    assert!(e4m3_to_f32(0xFF).is_sign_negative());
}

#[test]
fn casts_match_torch() {
    let v = vectors();
    let mut n = 0;
    for (d, cases) in v["casts"].as_object().expect("casts") {
        let d = dtype_of(d);
        let width = if d == Dtype::F32 { 8 } else { 4 };
        for c in cases.as_array().expect("list") {
            let c = c.as_str().expect("str");
            let x = widen(d, hex_u32(&c[..width]));
            let want = u8::from_str_radix(&c[width..], 16).expect("hex");
            assert_eq!(e4m3_from_f32(x), want, "{d:?} {c} ({x:e})");
            assert_eq!(e4m3_reference(x), want, "reference {d:?} {c}");
            n += 1;
        }
    }
    assert!(n > 3000, "{n} casts");
}

#[test]
fn cast_specials() {
    for (x, b) in [
        (0.0f32, 0x00u8),
        (-0.0, 0x80),
        (448.0, 0x7E),
        (464.0, 0x7E),
        (480.0, 0x7E),
        (1e30, 0x7E),
        (f32::INFINITY, 0x7E),
        (f32::NEG_INFINITY, 0xFE),
        (f32::NAN, 0x7F),
        (-f32::NAN, 0xFF),
        (f32::from_bits(1), 0x00),
        (-f32::from_bits(1), 0x80),
        (2f32.powi(-10), 0x00),        // tie between 0 and 2^-9: even
        (3.0 * 2f32.powi(-10), 0x02),  // tie between 1 and 2 units: even
        (2f32.powi(-9), 0x01),         // the smallest subnormal
        (15.0 * 2f32.powi(-10), 0x08), // 7.5 units: to 8 = the smallest normal
        (f32::MIN_POSITIVE, 0x00),
    ] {
        assert_eq!(e4m3_from_f32(x), b, "{x:e}");
    }
}

/// Every f32 bit pattern (release builds; every 4099th in debug ones) against the
/// reference, on every thread.
#[test]
fn cast_against_reference_over_f32() {
    use rayon::prelude::*;
    let stride: u64 = if cfg!(debug_assertions) { 4099 } else { 1 };
    let values: Vec<f64> = (0..=0x7Eu8).map(|c| f64::from(e4m3_to_f32(c))).collect();
    // A fast equivalent of e4m3_reference (same rule, the table hoisted), for 2^32 calls.
    let reference = |x: f32| -> u8 {
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        if x.is_nan() {
            return sign | 0x7F;
        }
        let a = f64::from(x.abs());
        if a >= 448.0 {
            return sign | 0x7E;
        }
        let hi = values.partition_point(|&v| v < a);
        if values[hi] == a || hi == 0 {
            return sign | hi as u8;
        }
        let (dl, dh) = (a - values[hi - 1], values[hi] - a);
        sign | if dl < dh || (dl == dh && (hi - 1) % 2 == 0) {
            hi - 1
        } else {
            hi
        } as u8
    };
    let bad = (0..(1u64 << 32) / (1 << 20))
        .into_par_iter()
        .map(|chunk| {
            let mut bad = 0u64;
            let mut u = chunk << 20;
            while u < (chunk + 1) << 20 {
                let x = f32::from_bits(u as u32);
                if e4m3_from_f32(x) != reference(x) {
                    bad += 1;
                }
                u += stride;
            }
            bad
        })
        .sum::<u64>();
    assert_eq!(bad, 0);
    for u in [
        0x3C80_0000u32,
        0x3C7F_FFFF,
        0x43E0_0000,
        0x43DF_FFFF,
        0x43E8_0000,
    ] {
        let x = f32::from_bits(u);
        assert_eq!(e4m3_from_f32(x), e4m3_reference(x), "{u:08x}");
    }
}

// ---- the groups -----------------------------------------------------------------------

/// The whole arithmetic of one group, spelled out (per element, via the public cast): the
/// reference for quantize_channel / quantize_band.
fn reference_group(d: Dtype, w: &[u32]) -> (u32, Vec<u8>) {
    let round = |x: f32| -> f32 {
        match d {
            Dtype::F32 => x,
            Dtype::BF16 => Bf16::round(x),
            _ => F16::round(x),
        }
    };
    let xs: Vec<f32> = w.iter().map(|&b| widen(d, b)).collect();
    let amax = xs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let mut s = round(amax / 448.0);
    if s == 0.0 {
        s = match d {
            Dtype::F32 => f32::EPSILON,
            Dtype::BF16 => 2f32.powi(-7),
            _ => 2f32.powi(-10),
        };
    }
    let q = xs
        .iter()
        .map(|&x| e4m3_from_f32(round(x / s).clamp(-448.0, 448.0)))
        .collect();
    let bits = match d {
        Dtype::F32 => s.to_bits(),
        Dtype::BF16 => s.to_bits() >> 16,
        _ => u32::from(f16_from_f32(s.to_bits())),
    };
    (bits, q)
}

fn scale_bits(d: Dtype, scales: &[u8], i: usize) -> u32 {
    match d {
        Dtype::F32 => u32::from_le_bytes(scales[4 * i..4 * i + 4].try_into().expect("4")),
        _ => u32::from(u16::from_le_bytes([scales[2 * i], scales[2 * i + 1]])),
    }
}

fn size(d: Dtype) -> usize {
    if d == Dtype::F32 {
        4
    } else {
        2
    }
}

/// The eager groups of the fixtures: rows through quantize_channel (scale, y in D and
/// the bytes model_free_ptq wrote), tiles (first 32 elements) from their written scale.
#[test]
fn eager_groups_match_model_free_ptq() {
    let v = vectors();
    let groups = v["groups"].as_array().expect("groups");
    assert_eq!(groups.len(), 42);
    for g in groups {
        let d = dtype_of(g["D"].as_str().expect("D"));
        let width = 2 * size(d);
        let name = format!("{} {} {}", g["fixture"], g["tensor"], g["group"]);
        let w = hex_words(g["w"].as_str().expect("w"), width);
        let y = hex_words(g["y_D"].as_str().expect("y"), width);
        let q_want = hex_bytes(g["q"].as_str().expect("q"));
        let s_want = hex_u32(g["scale"].as_str().expect("scale"));
        let amax = hex_u32(g["amax"].as_str().expect("amax"));
        let src = le_bytes(d, &w);
        // amax -> scale, for rows and tiles alike.
        let s_of = |amax: f32| match d {
            Dtype::F32 => (scale_of::<F32>(amax).0.to_bits(), scale_of::<F32>(amax).1),
            Dtype::BF16 => (
                scale_of::<Bf16>(amax).0.to_bits() >> 16,
                scale_of::<Bf16>(amax).1,
            ),
            _ => (
                u32::from(f16_from_f32(scale_of::<F16>(amax).0.to_bits())),
                scale_of::<F16>(amax).1,
            ),
        };
        let (s_got, was_zero) = s_of(widen(d, amax));
        assert_eq!(s_got, s_want, "{name}: scale of amax");
        let s = widen(d, s_want);
        // y in D, element by element.
        for (i, (&wb, &yb)) in w.iter().zip(&y).enumerate() {
            let yy = match d {
                Dtype::F32 => F32::round(widen(d, wb) / s).to_bits(),
                Dtype::BF16 => Bf16::round(widen(d, wb) / s).to_bits() >> 16,
                _ => u32::from(f16_from_f32(F16::round(widen(d, wb) / s).to_bits())),
            };
            assert_eq!(yy, yb, "{name}: y[{i}]");
        }
        let mut q = vec![0u8; w.len()];
        if g["group"].as_str().expect("group").starts_with("row") {
            let mut scales = vec![0u8; size(d)];
            let st = quantize_channel(d, w.len(), &src, &mut q, &mut scales);
            assert_eq!(scale_bits(d, &scales, 0), s_want, "{name}: scale");
            assert_eq!((st.groups, st.elements), (1, w.len() as u64));
            assert_eq!(st.zero_groups, u64::from(was_zero));
        } else {
            let mut acc = Acc::default();
            match d {
                Dtype::F32 => quantize_run::<F32>(&src, s, &mut q, &mut acc),
                Dtype::BF16 => quantize_run::<Bf16>(&src, s, &mut q, &mut acc),
                _ => quantize_run::<F16>(&src, s, &mut q, &mut acc),
            }
        }
        assert_eq!(q, q_want, "{name}: bytes");
        assert_eq!(reference_group(d, &w).1.len(), q.len());
    }
}

/// Random weights of a spread of magnitudes (some rows tiny, some with ties and zeros),
/// as bits of `d`.
fn random_weights(d: Dtype, n: usize, rng: &mut Rng) -> Vec<u32> {
    (0..n)
        .map(|i| {
            let r = rng.next();
            let x = match r % 16 {
                0 => 0.0,
                1 => -0.0,
                2 => ((r >> 8) % 15) as f32 * 0.5 - 3.5, // ties
                3 => f32::from_bits(((r >> 8) as u32) & 0x807F_FFFF), // f32 subnormals
                _ => {
                    let m = ((r >> 8) as u32 & 0xFFFF) as f32 / 65536.0 - 0.5;
                    m * 2f32.powi((i % 37) as i32 - 20)
                }
            };
            match d {
                Dtype::F32 => x.to_bits(),
                Dtype::BF16 => u32::from(bf16_from_f32(x.to_bits())),
                _ => u32::from(f16_from_f32(x.to_bits())),
            }
        })
        .collect()
}

#[test]
fn channel_matches_reference() {
    let mut rng = Rng(0x5EED_0001);
    for d in [Dtype::F32, Dtype::BF16, Dtype::F16] {
        for cols in [1, 7, 8, 9, 96, 128, 300] {
            let rows = 5;
            let w = random_weights(d, rows * cols, &mut rng);
            let src = le_bytes(d, &w);
            let mut q = vec![0u8; rows * cols];
            let mut scales = vec![0u8; rows * size(d)];
            let st = quantize_channel(d, cols, &src, &mut q, &mut scales);
            assert_eq!(
                (st.groups, st.elements),
                (rows as u64, (rows * cols) as u64)
            );
            for r in 0..rows {
                let (s, qr) = reference_group(d, &w[r * cols..(r + 1) * cols]);
                assert_eq!(scale_bits(d, &scales, r), s, "{d:?} cols {cols} row {r}");
                assert_eq!(
                    &q[r * cols..(r + 1) * cols],
                    &qr[..],
                    "{d:?} cols {cols} row {r}"
                );
            }
        }
    }
}

/// Bands of 1..=128 rows, widths with partial last tiles: each tile against the reference.
#[test]
fn band_matches_reference_with_partial_tiles() {
    let mut rng = Rng(0x5EED_0002);
    for d in [Dtype::F32, Dtype::BF16, Dtype::F16] {
        for (rows, cols) in [
            (1, 1),
            (1, 128),
            (3, 129),
            (64, 256),
            (70, 300),
            (128, 96),
            (128, 385),
        ] {
            let w = random_weights(d, rows * cols, &mut rng);
            let src = le_bytes(d, &w);
            let tiles = cols.div_ceil(128);
            let mut q = vec![0u8; rows * cols];
            let mut scales = vec![0u8; tiles * size(d)];
            let st = quantize_band(d, cols, &src, &mut q, &mut scales);
            assert_eq!(
                (st.groups, st.elements),
                (tiles as u64, (rows * cols) as u64)
            );
            for t in 0..tiles {
                let (c0, c1) = (t * 128, ((t + 1) * 128).min(cols));
                let tile: Vec<u32> = (0..rows)
                    .flat_map(|r| w[r * cols + c0..r * cols + c1].to_vec())
                    .collect();
                let (s, qt) = reference_group(d, &tile);
                assert_eq!(scale_bits(d, &scales, t), s, "{d:?} {rows}x{cols} tile {t}");
                let got: Vec<u8> = (0..rows)
                    .flat_map(|r| q[r * cols + c0..r * cols + c1].to_vec())
                    .collect();
                assert_eq!(got, qt, "{d:?} {rows}x{cols} tile {t}");
            }
        }
    }
}

#[test]
fn zero_groups_get_eps() {
    for (d, eps) in [
        (Dtype::F32, 0x3400_0000u32),
        (Dtype::BF16, 0x3C00),
        (Dtype::F16, 0x1400),
    ] {
        // Row 0 all +0, row 1 all -0, row 2 values whose amax/448 rounds to 0 in D.
        let tiny = match d {
            Dtype::F32 => 7,  // 1e-44: amax/448 underflows to 0
            Dtype::BF16 => 1, // the smallest bf16 subnormal
            _ => 1,           // the smallest f16 subnormal (2^-24)
        };
        let neg0 = if d == Dtype::F32 { 0x8000_0000 } else { 0x8000 };
        let w: Vec<u32> = [0u32; 4]
            .into_iter()
            .chain([neg0; 4])
            .chain([tiny, 0, tiny, 0])
            .collect();
        let src = le_bytes(d, &w);
        let mut q = [0u8; 12];
        let mut scales = vec![0u8; 3 * size(d)];
        let st = quantize_channel(d, 4, &src, &mut q, &mut scales);
        for r in 0..3 {
            assert_eq!(scale_bits(d, &scales, r), eps, "{d:?} row {r}");
        }
        assert_eq!(&q[..8], &[0, 0, 0, 0, 0x80, 0x80, 0x80, 0x80], "{d:?}");
        assert_eq!((st.zero_groups, st.groups), (3, 3), "{d:?}");
        // The tiny values flush to 0 in e4m3.
        assert_eq!(&q[8..], &[0, 0, 0, 0], "{d:?}");
        assert_eq!(st.flushed, 2, "{d:?}");
        // The same through a band (one tile).
        let mut qb = [0u8; 12];
        let mut sb = vec![0u8; size(d)];
        let st = quantize_band(d, 4, &src[..8 * size(d)], &mut qb[..8], &mut sb);
        assert_eq!((scale_bits(d, &sb, 0), st.zero_groups), (eps, 1));
    }
}

#[test]
fn subnormal_amax_keeps_a_subnormal_f32_scale() {
    // llama-fp32 q_proj row 5: amax 0x000ac429 -> scale 0x00000627 (kept, not eps).
    let w = [0x000a_c429u32, 0x8000_0001, 0];
    let src = le_bytes(Dtype::F32, &w);
    let mut q = [0u8; 3];
    let mut s = [0u8; 4];
    let st = quantize_channel(Dtype::F32, 3, &src, &mut q, &mut s);
    assert_eq!(u32::from_le_bytes(s), 0x0000_0627);
    assert_eq!(st.zero_groups, 0);
    assert_eq!(q[0], 0x7E);
    // Under FTZ/DAZ (as a -ffast-math library may leave them) the same bytes.
    #[cfg(target_arch = "x86_64")]
    {
        let (q2, s2) = crate::testutil::with_ftz_daz(|| {
            let mut q = [0u8; 3];
            let mut s = [0u8; 4];
            quantize_channel(Dtype::F32, 3, &src, &mut q, &mut s);
            (q, s)
        });
        assert_eq!((q2, s2), (q, s));
    }
}

/// What model_free_ptq wrote for rows with a NaN or an inf (README "NaN / inf groups").
#[test]
fn nonfinite_rows_as_torch() {
    for d in [Dtype::F32, Dtype::BF16] {
        let (nan, inf, one) = match d {
            Dtype::F32 => (0x7FC0_0000u32, 0x7F80_0000u32, 0x3F80_0000u32),
            _ => (0x7FC0, 0x7F80, 0x3F80),
        };
        let sign = if d == Dtype::F32 { 0x8000_0000 } else { 0x8000 };
        let mut w = vec![one; 4 * 128];
        w[128 + 5] = nan;
        w[2 * 128 + 7] = inf;
        w[3 * 128 + 9] = inf | sign;
        let src = le_bytes(d, &w);
        let mut q = vec![0u8; 4 * 128];
        let mut scales = vec![0u8; 4 * size(d)];
        assert!(has_nonfinite(d, &src));
        quantize_channel(d, 128, &src, &mut q, &mut scales);
        let s = scales_f32(d, &scales);
        assert!(s[1].is_nan() && s[1].is_sign_positive(), "{d:?}");
        assert_eq!((s[2], s[3]), (f32::INFINITY, f32::INFINITY), "{d:?}");
        assert!(q[128..256].iter().all(|&b| b == 0x7F), "{d:?} NaN row");
        let nan_byte = if d == Dtype::F32 { 0xFF } else { 0x7F };
        for (r, c) in [(2, 7), (3, 9)] {
            let row = &q[r * 128..(r + 1) * 128];
            assert_eq!(row[c], nan_byte, "{d:?} row {r}");
            assert_eq!(
                row.iter().filter(|&&b| b == 0).count(),
                127,
                "{d:?} row {r}"
            );
        }
    }
}

#[test]
fn has_nonfinite_finds_every_position() {
    for d in [Dtype::F32, Dtype::BF16, Dtype::F16] {
        let (inf, nan, max) = match d {
            Dtype::F32 => (0x7F80_0000u32, 0xFFC0_0001u32, 0x7F7F_FFFFu32),
            Dtype::BF16 => (0xFF80, 0x7F81, 0x7F7F),
            _ => (0x7C00, 0xFE00, 0x7BFF),
        };
        let n = 300;
        let clean = le_bytes(d, &vec![max; n]);
        assert!(!has_nonfinite(d, &clean), "{d:?}");
        for i in [0, 1, 63, 64, 127, 128, 299] {
            for bad in [inf, nan] {
                let mut w = vec![max; n];
                w[i] = bad;
                assert!(has_nonfinite(d, &le_bytes(d, &w)), "{d:?} at {i}");
            }
        }
    }
    assert!(!has_nonfinite(Dtype::I32, &[0xFF; 8]));
    assert!(!has_nonfinite(Dtype::F32, &[]));
}

#[test]
fn stats_measure_the_error() {
    // One 1.0 and the rest 1e-6 (as llama row 9): the small ones flush to ±0.
    let mut w = [1e-6f32; 16];
    w[3] = 1.0;
    w[4] = -1e-6;
    let src: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut q = [0u8; 16];
    let mut s = [0u8; 4];
    let st = quantize_channel(Dtype::F32, 16, &src, &mut q, &mut s);
    let s = f32::from_le_bytes(s);
    assert_eq!(s, 1.0 / 448.0);
    assert_eq!(st.flushed, 15);
    assert_eq!(q[4], 0x80);
    let mut want = Fp8Stats {
        elements: 16,
        groups: 1,
        ..Fp8Stats::default()
    };
    for (x, b) in w.iter().zip(q) {
        let err = (f64::from(e4m3_to_f32(b)) * f64::from(s) - f64::from(*x)).abs();
        want.max_abs_err = want.max_abs_err.max(err);
        want.sum_sq_err += err * err;
        want.sum_sq_src += f64::from(*x) * f64::from(*x);
    }
    assert_eq!((st.max_abs_err, st.flushed), (want.max_abs_err, 15));
    assert!((st.sum_sq_err - want.sum_sq_err).abs() <= 1e-12 * want.sum_sq_err);
    assert!((st.sum_sq_src - want.sum_sq_src).abs() <= 1e-12 * want.sum_sq_src);
    assert!(st.rel_err() > 0.0 && st.rel_err() < 0.01);
    let mut m = st;
    m.merge(&st);
    assert_eq!((m.elements, m.groups, m.flushed), (32, 2, 30));
    assert_eq!(m.max_abs_err, st.max_abs_err);
    assert_eq!(Fp8Stats::default().rel_err(), 0.0);
}

#[test]
fn other_dtypes_and_empty_inputs_write_nothing() {
    let mut q = [0xAAu8; 4];
    let mut s = [0xAAu8; 8];
    assert_eq!(
        quantize_channel(Dtype::F64, 1, &[0; 32], &mut q, &mut s),
        Fp8Stats::default()
    );
    assert_eq!(
        quantize_band(Dtype::I8, 4, &[0; 4], &mut q, &mut s),
        Fp8Stats::default()
    );
    assert_eq!(
        quantize_channel(Dtype::F32, 0, &[], &mut [], &mut []),
        Fp8Stats::default()
    );
    assert_eq!(
        quantize_band(Dtype::F32, 0, &[], &mut [], &mut []),
        Fp8Stats::default()
    );
    assert_eq!((q, s), ([0xAA; 4], [0xAA; 8]));
    // Widths and row indices no slice can hold: nothing written, no overflow panic.
    assert_eq!(
        quantize_channel(Dtype::F32, usize::MAX, &[0; 8], &mut q, &mut s),
        Fp8Stats::default()
    );
    assert_eq!(
        quantize_band(Dtype::BF16, usize::MAX / 2 + 1, &[0; 8], &mut q, &mut s),
        Fp8Stats::default()
    );
    let mut out = [0xAAu8; 8];
    // (Debug builds assert that q holds whole rows.)
    if !cfg!(debug_assertions) {
        let t = ScaleLayout::Tensor;
        dequantize(
            t,
            Dtype::F32,
            &[0; 4],
            None,
            usize::MAX,
            0,
            &q,
            Dtype::BF16,
            &mut out,
        );
        assert_eq!(out, [0xAA; 8]);
    }
    let block = ScaleLayout::Block { rows: 1, cols: 1 };
    dequantize(
        block,
        Dtype::F32,
        &[0; 4],
        None,
        4,
        usize::MAX,
        &q,
        Dtype::BF16,
        &mut out,
    );
    assert!(out
        .chunks_exact(2)
        .all(|o| u16::from_le_bytes([o[0], o[1]]) & 0x7FFF > 0x7F80));
}

// ---- dequantization -------------------------------------------------------------------

/// Rows of the fixtures with compressed-tensors' own bf16 (F16 scales: the product rounded
/// to f16 first, which an f32 product would get wrong on the rows picked).
#[test]
fn dequant_matches_compressed_tensors() {
    let v = vectors();
    let rows = v["dequant"].as_array().expect("dequant");
    assert!(rows.len() >= 30);
    let mut f16_diffs = 0;
    for r in rows {
        let name = format!("{} {} row {}", r["fixture"], r["tensor"], r["row"]);
        let sd = dtype_of(r["s_dtype"].as_str().expect("s_dtype"));
        let cols = r["cols"].as_u64().expect("cols") as usize;
        let row = r["row"].as_u64().expect("row") as usize;
        let q = hex_bytes(r["q"].as_str().expect("q"));
        let want = hex_bytes(r["out_bf16"].as_str().expect("out"));
        let srow = hex_bytes(r["scales"].as_str().expect("scales"));
        let (layout, scales) = if r["layout"] == "block" {
            // The whole scale tensor: the row's tile row in place, NaN in those above it.
            let nan: Vec<u8> = match sd {
                Dtype::F32 => f32::NAN.to_le_bytes().to_vec(),
                _ => 0x7E00u16.to_le_bytes().to_vec(),
            };
            let mut all: Vec<u8> = nan.repeat(srow.len() / size(sd) * (row / 128));
            all.extend_from_slice(&srow);
            (
                ScaleLayout::Block {
                    rows: 128,
                    cols: 128,
                },
                all,
            )
        } else {
            // Channel: scales of rows above as NaN, this row's scale at index `row`.
            let nan = if sd == Dtype::F32 {
                vec![0, 0, 0xC0, 0x7F]
            } else {
                vec![0, 0x7E]
            };
            let mut all = nan.repeat(row);
            all.extend_from_slice(&srow);
            (ScaleLayout::Channel, all)
        };
        let mut out = vec![0u8; 2 * cols];
        dequantize(
            layout,
            sd,
            &scales,
            None,
            cols,
            row,
            &q,
            Dtype::BF16,
            &mut out,
        );
        assert_eq!(out, want, "{name}");
        if sd == Dtype::F16 {
            f16_diffs += r["f32_product_diffs"].as_u64().expect("diffs");
        }
        // F16 target: the same product rounded to f16 (through S).
        let mut out16 = vec![0u8; 2 * cols];
        dequantize(
            layout,
            sd,
            &scales,
            None,
            cols,
            row,
            &q,
            Dtype::F16,
            &mut out16,
        );
        let s = scales_f32(sd, &scales);
        for (c, (b, o)) in q.iter().zip(out16.chunks_exact(2)).enumerate() {
            let si = match layout {
                ScaleLayout::Block { .. } => (row / 128) * cols.div_ceil(128) + c / 128,
                _ => row,
            };
            let p = e4m3_to_f32(*b) * s[si];
            let want = match sd {
                Dtype::F32 => f16_from_f32(p.to_bits()),
                Dtype::BF16 => f16_from_bf16(bf16_from_f32(p.to_bits())),
                _ => f16_from_f32(p.to_bits()),
            };
            assert_eq!(u16::from_le_bytes([o[0], o[1]]), want, "{name} f16 col {c}");
        }
    }
    assert!(
        f16_diffs > 100,
        "the f16 rows exercise the rounding through S"
    );
}

#[test]
fn dequant_layouts_and_subnormal_scales() {
    // Every code, 4 rows of 64, one tensor scale then per-row and 2x32 tiles.
    let q: Vec<u8> = (0..=255u8).collect();
    let s32 = [0.5f32, 2.0, f32::from_bits(0x0000_0627), 1e-3];
    let scales: Vec<u8> = s32.iter().flat_map(|s| s.to_le_bytes()).collect();
    let expect = |si: &dyn Fn(usize, usize) -> usize| -> Vec<u8> {
        q.iter()
            .enumerate()
            .flat_map(|(i, &b)| {
                let p = e4m3_to_f32(b) * s32[si(i / 64, i % 64)];
                bf16_from_f32(p.to_bits()).to_le_bytes()
            })
            .collect()
    };
    let run = |layout, row0: usize, q: &[u8]| {
        let mut out = vec![0u8; 2 * q.len()];
        dequantize(
            layout,
            Dtype::F32,
            &scales,
            None,
            64,
            row0,
            q,
            Dtype::BF16,
            &mut out,
        );
        out
    };
    assert_eq!(run(ScaleLayout::Tensor, 0, &q), expect(&|_, _| 0));
    assert_eq!(run(ScaleLayout::Channel, 0, &q), expect(&|r, _| r));
    let block = ScaleLayout::Block { rows: 2, cols: 32 };
    assert_eq!(run(block, 0, &q), expect(&|r, c| (r / 2) * 2 + c / 32));
    // Starting at row 2: the second tile row.
    assert_eq!(
        run(block, 2, &q[128..]),
        expect(&|r, c| (r / 2) * 2 + c / 32)[256..].to_vec()
    );
    // Under FTZ/DAZ the subnormal scale still counts.
    #[cfg(target_arch = "x86_64")]
    assert_eq!(
        crate::testutil::with_ftz_daz(|| run(ScaleLayout::Channel, 0, &q)),
        expect(&|r, _| r)
    );
    // Missing scales read as NaN; nothing panics.
    let out = run(ScaleLayout::Channel, 10, &q[..64]);
    assert!(out
        .chunks_exact(2)
        .all(|o| u16::from_le_bytes([o[0], o[1]]) & 0x7FFF > 0x7F80));
}

/// Zero points: `(q - zp) * s`, each step rounded to S, against values worked by hand
/// (and checked with torch 2.14 / compressed-tensors 0.19); every zero-point dtype.
#[test]
fn dequant_with_zero_points() {
    let e = |x: f32| e4m3_from_f32(x);
    let q = [e(3.0), e(-448.0), e(0.0625), 0x7F];
    let run = |s_dtype: Dtype, scales: &[u8], zp: ZeroPoints<'_>, target: Dtype| {
        let mut out = vec![0u8; 8];
        let t = ScaleLayout::Tensor;
        dequantize(t, s_dtype, scales, Some(zp), 4, 0, &q, target, &mut out);
        out.chunks(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect::<Vec<_>>()
    };
    let bf = |x: f32| bf16_from_f32(x.to_bits());
    let half = 0.5f32.to_le_bytes();
    // F32 scale, I32 zero point 257: exact in f32.
    let z = 257i32.to_le_bytes();
    let zp = ZeroPoints {
        dtype: Dtype::I32,
        data: &z,
    };
    let got = run(Dtype::F32, &half, zp, Dtype::BF16);
    let want = [
        (3.0 - 257.0) * 0.5,
        (-448.0 - 257.0) * 0.5,
        (0.0625 - 257.0) * 0.5,
    ];
    assert_eq!(got[..3], want.map(bf));
    assert_eq!(got[3] & 0x7FFF, 0x7FC0); // a NaN code stays NaN
                                         // BF16 scale: zp 257 is 256 in bf16; 0.0625 - 256 = -255.9375 rounds to -256 in bf16.
    let half_bf = 0x3F00u16.to_le_bytes();
    let got = run(Dtype::BF16, &half_bf, zp, Dtype::BF16);
    assert_eq!(got[..3], [-126.5f32, -352.0, -128.0].map(bf));
    // I32 rounded twice, as torch does (f32, then bf16): 2^24+2^16+1 -> 2^24, not 2^24+2^17.
    let z = (16_777_216i32 + 65_536 + 1).to_le_bytes();
    let zp = ZeroPoints {
        dtype: Dtype::I32,
        data: &z,
    };
    let one_bf = 0x3F80u16.to_le_bytes();
    assert_eq!(
        run(Dtype::BF16, &one_bf, zp, Dtype::BF16)[0],
        bf(-16_777_216.0)
    );
    // F16 scale: an I32 zero point over 65504 is inf in f16; q - inf = -inf.
    let z = 70_000i32.to_le_bytes();
    let zp = ZeroPoints {
        dtype: Dtype::I32,
        data: &z,
    };
    let one_h = 0x3C00u16.to_le_bytes();
    assert_eq!(run(Dtype::F16, &one_h, zp, Dtype::F16)[0], 0xFC00);
    // E4M3, I8 and I16 zero points: exact in every S.
    for (dtype, data) in [
        (Dtype::F8_E4M3, vec![e(-7.0)]),
        (Dtype::I8, vec![(-7i8) as u8]),
        (Dtype::I16, (-7i16).to_le_bytes().to_vec()),
    ] {
        let zp = ZeroPoints { dtype, data: &data };
        let got = run(Dtype::F32, &half, zp, Dtype::F16);
        let h = |x: f32| f16_from_f32(x.to_bits());
        assert_eq!(got[..3], [5.0f32, -220.5, 3.53125].map(h), "{dtype}");
    }
    // A zero point the tensor lacks reads as NaN (channel layout, row 1 of one zero point).
    let zp = ZeroPoints {
        dtype: Dtype::I8,
        data: &[1],
    };
    let mut out = vec![0u8; 16];
    let two = [half, half].concat();
    let q2 = [q, q].concat();
    let c = ScaleLayout::Channel;
    dequantize(
        c,
        Dtype::F32,
        &two,
        Some(zp),
        4,
        0,
        &q2,
        Dtype::BF16,
        &mut out,
    );
    assert!(out[8..]
        .chunks(2)
        .all(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7FFF > 0x7F80));
}
