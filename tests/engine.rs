//! The engine without Python: `stcast::convert` on small files in a temp folder.
//!
//! Failpoints are not exercised here: `STCAST_FAILPOINT` is read once per process, so
//! one test setting it would leak into the others (pytest covers them, one process each).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use safetensors::tensor::{Dtype, SafeTensors};
use stcast::kernels;
use stcast::{
    convert, ConvertTask, Error, ErrorKind, Isa, Options, ReadAdvice, Target, Task, Tuning,
    WarningKind,
};

/// Default options with a window of `window` bytes.
fn windowed(window: usize) -> Options {
    Options {
        tuning: Tuning {
            window,
            ..Tuning::default()
        },
        ..Options::default()
    }
}

/// A fresh folder under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("stcast-engine-{}-{n}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Every entry, hidden ones included, sorted.
    fn listing(&self) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Write a safetensors file: tensors laid out in the order given, header padded to 8.
fn write_file(path: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)], metadata: &str) {
    let mut json = String::from("{");
    if !metadata.is_empty() {
        json.push_str(&format!("\"__metadata__\":{metadata}"));
    }
    let mut offset = 0;
    let mut data = Vec::new();
    for (i, (name, dtype, shape, bytes)) in tensors.iter().enumerate() {
        if i > 0 || !metadata.is_empty() {
            json.push(',');
        }
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":[{}],\"data_offsets\":[{offset},{}]}}",
            dims.join(","),
            offset + bytes.len()
        ));
        offset += bytes.len();
        data.extend_from_slice(bytes);
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.extend_from_slice(&data);
    fs::write(path, out).unwrap();
}

/// A small deterministic generator (xorshift64*), so that no crate is needed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

const F32_EDGES: [u32; 24] = [
    0x0000_0000,
    0x8000_0000,
    0x7F80_0000,
    0xFF80_0000,
    0x7F7F_FFFF,
    0x3F80_8000,
    0x3F81_8000,
    0x3F80_7FFF,
    0x3F80_8001,
    0x3FFF_8000,
    0x0000_0001,
    0x807F_FFFF,
    0x0001_8000,
    0x007F_8000,
    0x7F80_0001,
    0xFFFF_FFFF,
    0xFFFF_8001,
    0x7FC0_0000,
    0x7F80_FFFF,
    0x7FFF_FFFF,
    0x3DCC_CCCD,
    0x4049_0FDB,
    0x7F7F_8000,
    0xFF7F_FFFF,
];

const F64_EDGES: [u64; 12] = [
    0x3FF0_1000_0000_1000,
    0x3790_0000_0400_0000,
    0x47EF_EFFF_FFFF_FFFF,
    0x47EF_F000_0000_0000,
    0x47F0_0000_0000_0000,
    0x7FEF_FFFF_FFFF_FFFF,
    0x0000_0000_0000_0001,
    0x7FF0_0000_0000_0001,
    0xFFF8_0000_0000_0000,
    0x8000_0000_0000_0000,
    0x3FF0_0000_0000_0000,
    0x37A8_0000_0000_0000,
];

fn u16s(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

struct Inputs {
    f32: Vec<u32>,
    f16: Vec<u16>,
    f64: Vec<u64>,
    i64: Vec<i64>,
}

fn inputs(n: usize) -> Inputs {
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    let mut f32: Vec<u32> = F32_EDGES.to_vec();
    f32.extend((0..n).map(|_| rng.next() as u32));
    let f16: Vec<u16> = (0..=u16::MAX).collect();
    let mut f64: Vec<u64> = F64_EDGES.to_vec();
    f64.extend((0..n).map(|_| rng.next()));
    // Doubles within bf16 range, where rounding (not overflow) decides.
    f64.extend((0..n).map(|_| {
        let r = rng.next();
        (r & 0x800F_FFFF_FFFF_FFFF) | ((0x370 + (r >> 52) % 0x110) << 52)
    }));
    let i64 = (0..37).map(|i| i * -1_000_000_007).collect();
    Inputs { f32, f16, f64, i64 }
}

fn bytes_of<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

fn write_inputs(path: &Path, inp: &Inputs) {
    write_file(
        path,
        &[
            (
                "i64",
                "I64",
                vec![inp.i64.len()],
                bytes_of(&inp.i64, i64::to_le_bytes),
            ),
            (
                "f32",
                "F32",
                vec![inp.f32.len()],
                bytes_of(&inp.f32, u32::to_le_bytes),
            ),
            (
                "f16",
                "F16",
                vec![inp.f16.len()],
                bytes_of(&inp.f16, u16::to_le_bytes),
            ),
            (
                "f64",
                "F64",
                vec![inp.f64.len()],
                bytes_of(&inp.f64, u64::to_le_bytes),
            ),
            ("flag", "BOOL", vec![3], vec![1, 0, 1]),
        ],
        r#"{"format":"pt"}"#,
    );
}

fn check_output(dst: &Path, inp: &Inputs) {
    let bytes = fs::read(dst).unwrap();
    let st = SafeTensors::deserialize(&bytes).expect("the safetensors crate accepts the output");
    let get = |name: &str| st.tensor(name).unwrap();

    let t = get("f32");
    assert_eq!((t.dtype(), t.shape()), (Dtype::BF16, &[inp.f32.len()][..]));
    for (i, (&x, y)) in inp.f32.iter().zip(u16s(t.data())).enumerate() {
        let want = kernels::bf16_from_f32(x);
        assert_eq!(y, want, "f32[{i}] {x:08X}");
    }
    let t = get("f16");
    assert_eq!(t.dtype(), Dtype::BF16);
    for (&x, y) in inp.f16.iter().zip(u16s(t.data())) {
        assert_eq!(y, kernels::bf16_from_f16(x), "f16 {x:04X}");
    }
    let t = get("f64");
    assert_eq!(t.dtype(), Dtype::BF16);
    for (&x, y) in inp.f64.iter().zip(u16s(t.data())) {
        assert_eq!(y, kernels::bf16_from_f64(x), "f64 {x:016X}");
    }
    let t = get("i64");
    assert_eq!(t.dtype(), Dtype::I64);
    assert_eq!(t.data(), &bytes_of(&inp.i64, i64::to_le_bytes)[..]);
    assert_eq!(get("flag").data(), &[1, 0, 1]);

    // Widest first: I64 leads; everything else is 2 bytes wide (input order) then BOOL.
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0);
    let json = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    let pos = |k: &str| json.find(&format!("\"{k}\"")).unwrap();
    assert!(
        json.starts_with(r#"{"__metadata__":{"format":"pt"},"i64":"#),
        "{json}"
    );
    assert!(pos("i64") < pos("f32") && pos("f32") < pos("f16"));
    assert!(pos("f16") < pos("f64") && pos("f64") < pos("flag"));
}

#[test]
fn kernels_agree_with_known_vectors() {
    assert_eq!(kernels::bf16_from_f32(0x3F80_0000), 0x3F80);
    assert_eq!(kernels::bf16_from_f32(0x3F81_8000), 0x3F82);
    assert_eq!(kernels::bf16_from_f32(0xFFFF_8001), 0xFFC0);
    assert_eq!(kernels::bf16_from_f32(0x0000_0001), 0x0000);
    assert_eq!(kernels::bf16_from_f32(0x0001_8000), 0x0002);
    assert_eq!(kernels::bf16_from_f16(0x0103), 0x3782);
    assert_eq!(kernels::bf16_from_f64(0x3FF0_1000_0000_1000), 0x3F81);
    assert_eq!(kernels::bf16_from_f64(0x3790_0000_0400_0000), 0x0001);
    assert_eq!(kernels::bf16_from_f64(0x47EF_EFFF_FFFF_FFFF), 0x7F7F);
    assert_eq!(kernels::bf16_from_f64(0x47F0_0000_0000_0000), 0x7F80);
}

#[test]
fn small_file_converts_element_wise() {
    let dir = TempDir::new("small");
    let (src, dst) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    let inp = inputs(4000);
    write_inputs(&src, &inp);
    let report = convert(&src, &dst, &Options::default()).unwrap();
    assert_eq!(report.tensors_converted, 3);
    assert_eq!(report.tensors_copied, 2);
    assert_eq!(report.bytes_in, fs::metadata(&src).unwrap().len());
    assert_eq!(report.bytes_out, fs::metadata(&dst).unwrap().len());
    assert_eq!(report.target, Target::Bf16);
    // The random inputs include huge and tiny values: the overflow guard's warning, then
    // the underflow one, and nothing else.
    let kinds: Vec<WarningKind> = report.warnings.iter().map(|w| w.kind).collect();
    assert_eq!(kinds, [WarningKind::Overflow, WarningKind::Underflow]);
    check_output(&dst, &inp);
    assert_eq!(dir.listing(), ["in.safetensors", "out.safetensors"]);
}

#[test]
fn small_windows_and_threads_give_the_same_bytes() {
    let dir = TempDir::new("windows");
    let src = dir.path("in.safetensors");
    // About 1.6 MB of F32 and 2.4 MB of F64: many 64 KiB windows, tensors split mid-way.
    let inp = inputs(300_000);
    write_inputs(&src, &inp);
    let mut outputs = Vec::new();
    for (i, (window, threads)) in [(8 << 20, 0), (64 << 10, 1), (64 << 10, 2), (100_000, 3)]
        .into_iter()
        .enumerate()
    {
        let dst = dir.path(&format!("out{i}.safetensors"));
        let opts = Options {
            threads,
            ..windowed(window)
        };
        let report = convert(&src, &dst, &opts).unwrap();
        if threads > 0 {
            assert_eq!(report.threads, threads);
        }
        outputs.push(fs::read(&dst).unwrap());
    }
    check_output(&dir.path("out1.safetensors"), &inp);
    for out in &outputs[1..] {
        assert!(out == &outputs[0], "output differs with window/threads");
    }
}

#[test]
fn tuning_knobs_give_the_same_bytes() {
    let dir = TempDir::new("knobs");
    let src = dir.path("in.safetensors");
    let inp = inputs(300_000);
    write_inputs(&src, &inp);
    let mut outputs = Vec::new();
    let knobs = [
        (true, ReadAdvice::Sequential, 1),
        (false, ReadAdvice::Normal, 1),
        (true, ReadAdvice::WillNeed, 2),
        (true, ReadAdvice::Sequential, 5),
    ];
    for (i, (populate, advise, depth)) in knobs.into_iter().enumerate() {
        let dst = dir.path(&format!("out{i}.safetensors"));
        let opts = Options {
            threads: 2,
            tuning: Tuning {
                window: 64 << 10,
                populate,
                advise,
                write_behind: depth,
                ..Tuning::default()
            },
            ..Options::default()
        };
        convert(&src, &dst, &opts).unwrap();
        outputs.push(fs::read(&dst).unwrap());
    }
    check_output(&dir.path("out0.safetensors"), &inp);
    for out in &outputs[1..] {
        assert!(
            out == &outputs[0],
            "output differs with populate/advice/write-behind"
        );
    }
}

#[test]
fn every_isa_gives_the_same_bytes() {
    let dir = TempDir::new("isa");
    let src = dir.path("in.safetensors");
    let inp = inputs(200_000);
    write_inputs(&src, &inp);
    let isas = Isa::available();
    assert_eq!(isas[0], Isa::Scalar);
    let mut outputs = Vec::new();
    for (isa, threads) in isas.iter().flat_map(|&i| [(i, 1), (i, 2)]) {
        let dst = dir.path(&format!("out-{}-{threads}.safetensors", isa.name()));
        let opts = Options {
            threads,
            tuning: Tuning {
                isa: Some(isa),
                window: 256 << 10,
                ..Tuning::default()
            },
            ..Options::default()
        };
        let report = convert(&src, &dst, &opts).unwrap();
        assert_eq!(report.isa, isa);
        check_output(&dst, &inp);
        outputs.push((isa, fs::read(&dst).unwrap()));
    }
    for (isa, out) in &outputs[1..] {
        assert!(out == &outputs[0].1, "{} differs from scalar", isa.name());
    }
}

#[test]
fn job_steps_in_small_budgets_and_reports_progress() {
    let dir = TempDir::new("steps");
    let (src, dst) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    let inp = inputs(100_000);
    write_inputs(&src, &inp);
    let opts = windowed(64 << 10);
    let mut job = ConvertTask::new(&src, &dst, &opts).unwrap();
    let (mut last, total) = job.progress();
    assert_eq!(last, 0);
    let mut steps = 0;
    while !job.step(100_000).unwrap() {
        let (done, t) = job.progress();
        assert_eq!(t, total);
        assert!(done > last && done < total);
        last = done;
        steps += 1;
    }
    assert_eq!(job.progress(), (total, total));
    assert!(steps > 3);
    // Nothing is visible until `finish`.
    assert_eq!(dir.listing(), ["in.safetensors"]);
    job.finish().unwrap();
    check_output(&dst, &inp);
}

#[test]
fn dropped_job_leaves_nothing() {
    let dir = TempDir::new("drop");
    let (src, dst) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_inputs(&src, &inputs(100_000));
    let opts = windowed(64 << 10);
    let mut job = ConvertTask::new(&src, &dst, &opts).unwrap();
    assert!(!job.step(1).unwrap());
    drop(job);
    assert_eq!(dir.listing(), ["in.safetensors"]);

    // Also with an existing destination under force: it stays as it was.
    fs::write(&dst, b"old").unwrap();
    let opts = Options {
        force: true,
        ..opts
    };
    let mut job = ConvertTask::new(&src, &dst, &opts).unwrap();
    while !job.step(1 << 20).unwrap() {}
    drop(job);
    assert_eq!(fs::read(&dst).unwrap(), b"old");
    assert_eq!(dir.listing(), ["in.safetensors", "out.safetensors"]);
}

fn small_src(dir: &TempDir) -> PathBuf {
    let src = dir.path("in.safetensors");
    write_file(
        &src,
        &[("a", "F32", vec![1], 1.5f32.to_le_bytes().to_vec())],
        "",
    );
    src
}

#[test]
fn existing_destination_is_refused_without_force() {
    let dir = TempDir::new("exists");
    let src = small_src(&dir);
    let dst = dir.path("out.safetensors");
    fs::write(&dst, b"keep").unwrap();
    let err = convert(&src, &dst, &Options::default()).unwrap_err();
    assert!(matches!(err, Error::DestinationExists { .. }), "{err:?}");
    assert_eq!(err.kind(), ErrorKind::DestinationExists);
    assert_eq!(err.path(), Some(dst.as_path()));
    assert!(err.to_string().contains("destination exists"), "{err}");
    assert_eq!(fs::read(&dst).unwrap(), b"keep");
    assert_eq!(dir.listing(), ["in.safetensors", "out.safetensors"]);

    let opts = Options {
        force: true,
        ..Options::default()
    };
    convert(&src, &dst, &opts).unwrap();
    let bytes = fs::read(&dst).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("a").unwrap().data(), &[0xC0, 0x3F]);
    assert_eq!(dir.listing(), ["in.safetensors", "out.safetensors"]);
}

#[test]
fn destination_equal_to_source_is_refused() {
    let dir = TempDir::new("same");
    let src = small_src(&dir);
    let before = fs::read(&src).unwrap();
    let link = dir.path("link.safetensors");
    std::os::unix::fs::symlink(&src, &link).unwrap();
    for force in [false, true] {
        let opts = Options {
            force,
            ..Options::default()
        };
        for dst in [&src, &link] {
            let err = convert(&src, dst, &opts).unwrap_err();
            assert!(matches!(err, Error::DestinationIsInput { .. }), "{err:?}");
            assert!(
                err.to_string().contains("destination is the input"),
                "{err}"
            );
        }
    }
    assert_eq!(fs::read(&src).unwrap(), before);
    assert_eq!(dir.listing(), ["in.safetensors", "link.safetensors"]);
}

#[test]
fn missing_folders_are_made_and_a_missing_input_is_an_error() {
    let dir = TempDir::new("missing");
    let src = small_src(&dir);
    let dst = dir.path("no/deeper/out.safetensors");
    convert(&src, &dst, &Options::default()).unwrap();
    assert!(dst.is_file());
    // Above a file, no folder can be made: refused, naming it, before anything is made.
    fs::write(dir.path("afile"), b"x").unwrap();
    let err = convert(
        &src,
        &dir.path("afile/no/out.safetensors"),
        &Options::default(),
    )
    .unwrap_err();
    match &err {
        Error::NoDestinationFolder { dir: at, exists } => {
            assert!(*exists && at == &dir.path("afile"), "{err:?}")
        }
        _ => panic!("{err:?}"),
    }
    // Folders made for an output that is never published are removed again.
    let made = stcast::output::MadeDirs::for_output(&dir.path("x/y/out.safetensors")).unwrap();
    assert!(dir.path("x/y").is_dir());
    drop(made);
    assert!(!dir.path("x").exists());
    // A folder put in place of one it made (that one moved away, another made under its
    // name) is not the run's: it stays (device and inode differ), and so does the moved one.
    let made = stcast::output::MadeDirs::for_output(&dir.path("p/q/out.safetensors")).unwrap();
    fs::rename(dir.path("p/q"), dir.path("p/moved")).unwrap();
    fs::create_dir(dir.path("p/q")).unwrap();
    drop(made);
    assert!(dir.path("p/q").is_dir() && dir.path("p/moved").is_dir());
    fs::remove_dir_all(dir.path("p")).unwrap();
    stcast::output::MadeDirs::for_output(&dir.path("kept/out.safetensors"))
        .unwrap()
        .keep();
    assert!(dir.path("kept").is_dir());
    let missing = dir.path("missing.safetensors");
    let err = convert(&missing, &dir.path("out.safetensors"), &Options::default()).unwrap_err();
    match &err {
        Error::Io { path, source, .. } => {
            assert_eq!(path, &missing);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected an I/O error, got {other:?}"),
    }
    assert_eq!(dir.listing(), ["afile", "in.safetensors", "kept", "no"]);
}

#[test]
fn invalid_input_is_reported_with_its_path() {
    let dir = TempDir::new("invalid");
    let src = dir.path("bad.safetensors");
    let header = br#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0; 8]);
    fs::write(&src, bytes).unwrap();
    let err = convert(&src, &dir.path("out.safetensors"), &Options::default()).unwrap_err();
    assert!(matches!(err, Error::InvalidHeader { .. }), "{err:?}");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(
        err.to_string().starts_with(&format!("{}: ", src.display())),
        "{err}"
    );
    assert_eq!(dir.listing(), ["bad.safetensors"]);
}

#[test]
fn fp16_target() {
    let dir = TempDir::new("fp16");
    let (src, dst) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    let values = [1.5f32, -2.0, 65504.0, 1e-8, 0.1];
    let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_file(&src, &[("a", "F32", vec![5], data)], "");
    let report = convert(&src, &dst, &Options::new(Target::F16)).unwrap();
    assert_eq!(report.target, Target::F16);
    let bytes = fs::read(&dst).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("a").unwrap();
    assert_eq!(t.dtype(), Dtype::F16);
    assert_eq!(u16s(t.data()), [0x3E00, 0xC000, 0x7BFF, 0x0000, 0x2E66]);
}

/// The F32 values of `bytes` as bf16 bits, by the reference kernel.
fn bf16_of(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|v| kernels::bf16_from_f32(v.to_bits()))
        .collect()
}

#[test]
fn a_source_of_several_files_and_gathered_views_converts_each_tensor() {
    use stcast::header::{SourceHeader, SourceTensor};
    use stcast::source::InputFile;
    use stcast::torch::TensorDesc;
    use stcast::Source;

    let dir = TempDir::new("composite");
    let a: Vec<f32> = (0..6).map(|i| i as f32 * 1.1 + 0.3).collect();
    let b: Vec<f32> = vec![-2.5, 1e-3, 3.4e38, 7.0];
    let le = |v: &[f32]| bytes_of(v, f32::to_le_bytes);
    write_file(
        &dir.path("a.safetensors"),
        &[("a", "F32", vec![2, 3], le(&a))],
        "",
    );
    write_file(
        &dir.path("b.safetensors"),
        &[("b", "F32", vec![4], le(&b))],
        "",
    );
    // A plain file of big-endian floats: a storage as a legacy torch checkpoint has them.
    fs::write(dir.path("be.bin"), bytes_of(&b, f32::to_be_bytes)).unwrap();

    let sa = Source::open(&dir.path("a.safetensors")).unwrap();
    let sb = Source::open(&dir.path("b.safetensors")).unwrap();
    let be = InputFile::open(&dir.path("be.bin"), 1, |_| unreachable!()).unwrap();
    let (ta, tb) = (sa.header.tensors[0].clone(), sb.header.tensors[0].clone());
    let a_base = sa.files[0].base;
    let desc = |shape: Vec<u64>, stride: Vec<u64>, data_start: u64, big_endian: bool| {
        let data_len = shape.iter().product::<u64>() * 4;
        Some(Box::new(
            TensorDesc {
                dtype: Dtype::F32,
                torch_dtype: "float32",
                shape,
                stride,
                storage_offset: 0,
                storage: 0,
                data_start,
                data_len,
                big_endian,
            }
            .into(),
        ))
    };
    let transposed = SourceTensor {
        name: "a.T".into(),
        shape: vec![3, 2],
        gather: desc(vec![3, 2], vec![1, 3], a_base + ta.start, false),
        ..ta.clone()
    };
    let swapped = SourceTensor {
        name: "b.be".into(),
        shape: vec![4],
        input: 2,
        start: 0,
        end: 16,
        gather: desc(vec![4], vec![1], 0, true),
        ..tb.clone()
    };
    let tb = SourceTensor { input: 1, ..tb };
    let header = SourceHeader {
        header_len: sa.header.header_len + sb.header.header_len,
        metadata: None,
        tensors: vec![ta, tb, transposed, swapped],
        weight_shapes: Vec::new(),
    };
    let mut files = sa.files;
    files.extend(sb.files);
    files.push(be);
    let src = Source::from_parts(&dir.path("a.safetensors"), files, header);
    let dst = dir.path("out.safetensors");
    let mut task =
        ConvertTask::from_source(src, &dst, &windowed(64 << 10), std::time::Instant::now())
            .unwrap();
    stcast::task::run(&mut task).unwrap();
    let report = task.finish().unwrap();
    assert_eq!(report.tensors_converted, 4);
    let bytes = fs::read(&dst).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let got = |name: &str| u16s(st.tensor(name).unwrap().data());
    let at: Vec<f32> = (0..3).flat_map(|j| [a[j], a[3 + j]]).collect();
    assert_eq!(got("a"), bf16_of(&a));
    assert_eq!(got("b"), bf16_of(&b));
    assert_eq!(got("a.T"), bf16_of(&at));
    assert_eq!(got("b.be"), bf16_of(&b));
    assert_eq!(st.tensor("a.T").unwrap().shape(), &[3, 2]);
    // The overflowing value of `b` was counted in both tensors that hold it.
    let over: u64 = report.numerics.iter().map(|(_, n)| n.overflow).sum();
    assert_eq!(over, 2);
}

/// One tensor assembled from boxes in several files (as a distributed checkpoint holds it):
/// 2x2 tiles in 4 files, and row bands in 2, converted and verified in windows smaller
/// than the tensor, equal to converting the whole tensor.
#[test]
fn a_tensor_of_pieces_in_several_files_converts_and_verifies_as_the_whole() {
    use stcast::gather::{Piece, Pieces};
    use stcast::header::{SourceHeader, SourceTensor};
    use stcast::source::InputFile;
    use stcast::{Source, Verifier, VerifyOptions};

    let dir = TempDir::new("pieces");
    let (rows, cols) = (96u64, 200u64);
    let whole: Vec<f32> = (0..rows * cols)
        .map(|i| (i as f32 * 0.37).sin() * 1e3 + i as f32 * 1e-3)
        .collect();
    // (file, offsets, sizes) of each box; each file holds its boxes one after another.
    let tiles: Vec<(usize, [u64; 2], [u64; 2])> = vec![
        (0, [0, 0], [40, 120]),
        (1, [0, 120], [40, 80]),
        (2, [40, 0], [56, 120]),
        (3, [40, 120], [56, 80]),
    ];
    let bands: Vec<(usize, [u64; 2], [u64; 2])> =
        vec![(4, [0, 0], [30, cols]), (5, [30, 0], [66, cols])];
    let mut contents: Vec<Vec<u8>> = vec![b"junk".to_vec(); 6];
    let mut make = |boxes: &[(usize, [u64; 2], [u64; 2])]| -> Vec<Piece> {
        boxes
            .iter()
            .map(|&(file, o, z)| {
                let start = contents[file].len() as u64;
                for r in o[0]..o[0] + z[0] {
                    for c in o[1]..o[1] + z[1] {
                        let v = whole[(r * cols + c) as usize];
                        contents[file].extend_from_slice(&v.to_le_bytes());
                    }
                }
                Piece {
                    input: file,
                    bytes: start..contents[file].len() as u64,
                    offsets: o.to_vec(),
                    sizes: z.to_vec(),
                }
            })
            .collect()
    };
    let tiled = make(&tiles);
    let banded = make(&bands);
    let names: Vec<PathBuf> = (0..6).map(|i| dir.path(&format!("rank{i}.bin"))).collect();
    for (name, bytes) in names.iter().zip(&contents) {
        fs::write(name, bytes).unwrap();
    }
    let shape = [rows, cols];
    let tensor = |name: &str, pieces: Vec<Piece>| {
        let p = Pieces::new(name, Dtype::F32, &shape, pieces).unwrap();
        let start = p.pieces()[0].bytes.start;
        SourceTensor {
            name: name.into(),
            dtype: Dtype::F32,
            shape: vec![rows as usize, cols as usize],
            start,
            end: start + p.nbytes(),
            input: p.pieces()[0].input,
            gather: Some(Box::new(p.into())),
        }
    };
    let source = || {
        let files: Vec<InputFile> = names
            .iter()
            .map(|n| InputFile::open(n, 1, |_| unreachable!()).unwrap())
            .collect();
        let header = SourceHeader {
            header_len: 0,
            metadata: None,
            tensors: vec![
                tensor("tiled", tiled.clone()),
                tensor("banded", banded.clone()),
            ],
            weight_shapes: Vec::new(),
        };
        Source::from_parts(&names[0], files, header)
    };
    let dst = dir.path("out.safetensors");
    // 16 KiB windows: a tensor of 75 KiB is read in 5, each crossing boxes.
    let mut task = ConvertTask::from_source(
        source(),
        &dst,
        &windowed(16 << 10),
        std::time::Instant::now(),
    )
    .unwrap();
    stcast::task::run(&mut task).unwrap();
    let report = task.finish().unwrap();
    assert_eq!(report.tensors_converted, 2);
    let bytes = fs::read(&dst).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for name in ["tiled", "banded"] {
        assert_eq!(
            u16s(st.tensor(name).unwrap().data()),
            bf16_of(&whole),
            "{name}"
        );
        assert_eq!(
            st.tensor(name).unwrap().shape(),
            &[rows as usize, cols as usize]
        );
    }
    // Verify reads the pieces through the same gather, and finds the output exact.
    let out = Source::open(&dst).unwrap();
    let opts = VerifyOptions::default();
    let mut v = Verifier::from_sources(source(), out, &opts, std::time::Instant::now()).unwrap();
    while !v.step(16 << 10).unwrap() {}
    let report = v.finish().unwrap();
    assert!(report.mismatch.is_none(), "{:?}", report.mismatch);
    assert_eq!(report.tensors_converted, 2);
    // A piece's file truncated after it was opened is reported, not read past its end.
    let src = source();
    let f = fs::OpenOptions::new().write(true).open(&names[3]).unwrap();
    f.set_len(contents[3].len() as u64 / 2).unwrap();
    let dst = dir.path("out2.safetensors");
    let mut task =
        ConvertTask::from_source(src, &dst, &windowed(16 << 10), std::time::Instant::now())
            .unwrap();
    let err = stcast::task::run(&mut task).unwrap_err();
    assert!(matches!(err, stcast::Error::InputChanged { .. }), "{err}");
    assert!(err.to_string().contains("rank3.bin"), "{err}");
}
