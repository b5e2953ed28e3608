//! What the engine tells its caller: one `Error` variant per failure, and `Warning`s.
//!
//! Each variant carries its data (paths, tensors, numbers) and belongs to one
//! `vocab::ErrorKind`, which front ends map to an exception class or an exit status. The
//! text is a `text` template: it never names a CLI flag or a Python keyword, only options
//! as placeholders (`{force}`), which each front end renders in its own words.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use crate::text::{count, esc, esc_path, format_bytes, name_list, plain};
use crate::torch::{Format, TensorProblem, TorchError};
use crate::vocab::{ErrorKind, OptionName, Side, Taken, Target, WarningKind};

/// What is wrong with a distributed checkpoint, beyond what its pickles' reader says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DistProblem {
    /// `.metadata` is not what `torch.distributed.checkpoint` writes: `what` says where.
    Metadata { what: String },
    /// A tensor stored through a transform (compression, ...): stcast reads plain items.
    Transformed { descriptors: Vec<String> },
    /// An item's file: not a plain name inside the folder, or unreadable.
    ItemFile { file: String, reason: String },
    /// An item's bytes lie past the end of its file.
    PastEnd { file: String, end: u64, len: u64 },
    /// An item is not the tensor the metadata says.
    Item {
        file: String,
        offset: u64,
        reason: String,
    },
    /// The chunks do not tile the tensor (overlap, gap, outside its size).
    Chunks { reason: String },
    /// A file of a folder of HuggingFaceStorageWriter shards that is not one of them.
    Shard { what: String },
    /// A DeepSpeed ZeRO checkpoint whose files disagree with each other or with what
    /// DeepSpeed writes (partition sizes that do not add up, a missing rank): `what` says.
    Zero { what: String },
    /// A DeepSpeed checkpoint of a layout stcast does not read (model or pipeline
    /// parallel): `what` names it.
    ZeroUnsupported { what: String },
    /// `key` given for a DeepSpeed ZeRO checkpoint, which holds one state dict.
    ZeroKey { key: String },
    /// One rank's file of a distributed checkpoint given alone (a ZeRO-3 model states file,
    /// whose parameters are empty placeholders; a `.distcp` file): `what` says which, and
    /// `folder` is the checkpoint to convert instead.
    RankFile { what: String, folder: PathBuf },
}

/// What the walk of a source folder (`run::walk`) refuses in it, before anything is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WalkProblem {
    /// A symlink whose target does not exist.
    BrokenLink,
    /// A symlink to a folder inside the source folder (`target`): its files would be
    /// written twice, once under each name.
    LinkInside { target: PathBuf },
    /// A symlink to a folder already walked.
    Loop,
    /// A FIFO, socket or device.
    NotRegular,
    /// Two files that would be written under the same relative path `rel`.
    SameName { rel: PathBuf, other: PathBuf },
    /// `STEM-0000i-of-N` shards with the first missing one the error's path and `more`
    /// others missing, no index beside them; `pytorch`: PyTorch shards of the same name
    /// were left out in their favour.
    Incomplete {
        more: usize,
        stem: String,
        total: String,
        pytorch: bool,
    },
    /// No weight file: neither `.safetensors` files nor PyTorch weights.
    NoWeights,
}

/// What a folder run's plan (`run::plan`) refuses in one of the source's configs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigProblem {
    /// The model config of an FP8 target's run is not a JSON object.
    NotAnObject,
    /// Its quantization (under `key`; `method`: its `quant_method` as JSON, if set) is not a
    /// scheme stcast dequantizes (`detail` says why, when it helps), and the files hold
    /// quantized weights with scales.
    Unread {
        key: &'static str,
        method: Option<String>,
        detail: String,
    },
    /// SRC's own file lies where an FP8 run writes the quantization_config of weights no
    /// model config describes (`folder::side_configs`): copied there, it would stand for
    /// stcast's, which it is not. `rel`: its path in SRC.
    SideTaken { rel: String },
}

/// Where a folder run would read or write that it refuses (`run::place`), before anything
/// is written; the error's path is the source or the destination at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlaceProblem {
    /// The source does not exist: a folder, or (`folder` false) a file to re-shard.
    Missing { folder: bool },
    /// The source is not a folder; `file`: a file to re-shard that is not a regular file.
    NotAFolder { file: bool },
    /// The destination exists and is not a folder; `resharding` a file writes one.
    DstNotAFolder { resharding: bool },
    /// The destination is named like a file (`x.safetensors`) and is not a folder, and the
    /// run writes a folder (`resharding`: because of the shard size, else because the
    /// source is a folder of files): `folder` is the one to name instead. A usage error.
    DstLikeFile { resharding: bool, folder: PathBuf },
    /// The destination is the source folder or lies inside it.
    DstInSource,
    /// The destination contains the source folder.
    DstHoldsSource,
    /// The destination lies inside the checkpoint folder `src` (DCP, ZeRO) being re-sharded.
    DstInCheckpoint { src: PathBuf },
    /// An output is the source's file `input` (a hard link, or a symlink to it).
    OutputIsInput { input: PathBuf },
    /// An output of a lone file re-sharded is that file (re-sharded into its own folder,
    /// where one shard takes its name).
    OutputIsTheFile,
    /// An output is, or lies in, a folder of the source (a bind mount of one under DST).
    OutputInSource,
    /// A source that is not there but reads like the Hugging Face Hub repo `repo` (its id
    /// or URL): stcast converts local files.
    HubRepo { repo: String },
    /// Verify's DST folder holds the outputs `convert` names by default for two targets
    /// (`first`, `second`), and no target was given: a usage error of the target.
    HoldsBoth {
        first: std::ffi::OsString,
        second: std::ffi::OsString,
    },
    /// verify: DST (a folder SRC is compared with) exists and is not a folder.
    VerifyDstNotAFolder { src: PathBuf },
    /// verify: SRC and DST are the same folder (by device and inode).
    SameFolder,
    /// A folder an output is written into exists and is not a folder (a link, a file).
    InTheWay,
    /// A Hugging Face cache repo's `refs/main` names a snapshot `snapshots` does not hold.
    NoSnapshot { commit: String, snapshots: PathBuf },
    /// A Hugging Face cache repo without `refs/main`, and not one snapshot but `found`.
    Snapshots {
        found: Vec<std::ffi::OsString>,
        snapshots: PathBuf,
    },
}

/// What a folder run refuses about the manifests in its destination (`run::manifest`);
/// the error's path is the manifest, or the destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestProblem {
    /// A manifest stcast cannot read (`reason`), found by a conversion or by `finalize`.
    Unreadable { reason: String, finalize: bool },
    /// A manifest of another source (`src`) is in the destination.
    OtherSource { src: PathBuf },
    /// This run's own manifest `name` is there: a whole run stopped, or (`shard`) this shard ran.
    Stopped { name: String, shard: bool },
    /// A whole-folder run into a folder of this source's shard runs.
    ShardRuns,
    /// Shard runs of this source with other options.
    OtherOptions,
    /// Another run saved its manifest at this run's name after this run checked `dst`.
    StartedMeanwhile { dst: PathBuf },
    /// A file this run would publish was written by another run (or program) after this
    /// run checked `dst`, where this run replaces none (or another than it found).
    Rival { dst: PathBuf },
    /// Another run replaced or removed this run's manifest (`dst`: the folder it took over).
    TakenOver { dst: PathBuf },
    /// A file this run wrote was replaced or removed during the run.
    Changed,
    /// `finalize` of a destination that is no folder.
    NoFolder,
    /// `finalize` of a destination without a manifest of this source.
    NothingToFinalize,
    /// `finalize` while a run (a whole-folder run, or shard `shard`) has not finished.
    Unfinished { shard: Option<(u64, u64)> },
    /// The shard runs' manifests record different options (`listed`).
    Disagree { listed: String },
    /// The manifests record a `max_shard_size` (`value`, as JSON) that is no size.
    BadSize { value: String },
    /// The manifests record a `name` (`value`, as JSON) that is no file name stem.
    BadName { value: String },
}

/// What a folder run refuses about the files in its destination (`run::survey`); each
/// names the files (`listed`, relative to the destination).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SurveyProblem {
    /// Files the run would write that no manifest proves stcast's (`resume`: asked to resume;
    /// `finalize`: the run is a `finalize`, which takes no `force`).
    Unproven {
        listed: Vec<std::ffi::OsString>,
        resume: bool,
        finalize: bool,
    },
    /// Files stcast did not write, where the run writes none.
    Foreign { listed: Vec<std::ffi::OsString> },
    /// Files named as the output's weights or index that the run does not write.
    Leftovers { listed: Vec<std::ffi::OsString> },
}

/// What keeps a tensor of an FP8 checkpoint from being dequantized as compressed-tensors
/// does it (`quant::dequantizable`); the text follows "tensor `X`".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fp8Problem {
    /// A quantized tensor without a scale stcast reads beside it.
    NoScale,
    /// A quantized tensor of a folder dequantized whole left as it is: its scale is in
    /// another file, or there is none.
    NoScaleHere,
    /// A companion of a quantized weight (`role`: a scale, zero point, global scale or
    /// shape, `quant::companion_role`) in `dtype` whose weight is not in this file.
    NoWeight { role: &'static str, dtype: String },
    /// An FP8 weight with both `X.weight_scale` and `X.weight_scale_inv`.
    TwoScales { scale: String, scale_inv: String },
    /// A scale or zero point of FP8 weight `weight` in a dtype stcast does not dequantize
    /// with.
    Dtype {
        weight: String,
        zero_point: bool,
        dtype: String,
    },
    /// A scale of a shape that no layout of the weight's gives (`expected`: the weight's
    /// shape), or a zero point not shaped as its scale (`expected`: the scale's).
    Shape {
        weight: String,
        zero_point: bool,
        shape: Vec<usize>,
        expected: Vec<usize>,
    },
    /// A scale or zero point not stored whole beside its weight (a strided or big-endian
    /// view, pieces, or another file of the checkpoint).
    NotBeside { weight: String, zero_point: bool },
    /// A zero point beside DeepSeek's `weight_scale_inv`, a format without zero points.
    ZeroPointWithScaleInv { weight: String, scale_inv: String },
    /// A scale whose shape fits two layouts of its one-row weight (`expected`) that group
    /// the columns differently: 128-column blocks, or groups of cols/G.
    AmbiguousScale {
        weight: String,
        shape: Vec<usize>,
        expected: Vec<usize>,
    },
    /// A packed weight (or a companion of one) in `format` whose tensors do not make a layout
    /// stcast dequantizes exactly: `detail` says what does not fit.
    Packed {
        format: &'static str,
        detail: String,
    },
    /// A packed weight (in `format`) that the folder's model config `config` describes otherwise than its
    /// tensors store it: the config `says` (`num_bits 8`), the tensors hold (`4-bit codes`).
    Config {
        format: &'static str,
        config: PathBuf,
        says: String,
        holds: String,
    },
    /// A quantized weight that is dequantized, or a tensor its dequantization reads and drops,
    /// that the `keep` pattern `pattern` matches: neither can keep its dtype (the codes mean
    /// nothing without the scales, and the output's config has no quantization_config).
    Kept { pattern: String },
    /// A `targets` or `ignore` entry `pattern` of config `config` that stcast cannot match
    /// as compressed-tensors (Python's `re`) does: `reason` says why.
    Pattern {
        config: PathBuf,
        pattern: String,
        reason: String,
    },
    /// A packed weight whose dequantized name `out` is also the output name of `other`
    /// (a tensor of that name kept beside it, or another packed weight).
    NameTaken { out: String, other: String },
    /// `values` of the weight, once dequantized, overflow `target` while overflowing
    /// tensors are to be kept: a dequantized weight has no dtype of its own to keep.
    Overflow {
        values: u64,
        target: crate::vocab::Target,
    },
}

/// What to do about `tensors` overflowing the target, `dequantized` of them dequantized
/// weights: the others can keep their dtype, a dequantized weight has none of its own
/// (its codes mean nothing without the scales dequantization drops), so only a wider
/// target holds its values.
pub(crate) fn overflow_advice(dequantized: usize, tensors: usize) -> String {
    let keep = "in their dtype with {on_overflow=keep} or a {keep} pattern";
    let wider = "a dequantized weight has no dtype of its own to keep: {to=bf16} holds its values";
    match dequantized {
        0 => format!("keep them {keep}"),
        d if d == tensors => wider.to_string(),
        d => format!("{d} of the {tensors} tensors dequantized: {wider}; keep the others {keep}"),
    }
}

impl fmt::Display for Fp8Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let role = |zp: bool| if zp { "zero point" } else { "scale" };
        match self {
            Fp8Problem::NoScale => write!(
                f,
                "is quantized without a scale stcast reads beside it (`X.weight_scale` or \
                 `X.weight_scale_inv` in F32, BF16 or F16, per tensor, channel, group or \
                 128x128 block, and optionally `X.weight_zero_point`)"
            ),
            Fp8Problem::NoScaleHere => {
                write!(f, "is quantized without a scale beside it in this file")
            }
            Fp8Problem::NoWeight { role, dtype } => {
                write!(f, "is a {role} ({dtype}) whose weight is not in this file")
            }
            Fp8Problem::TwoScales { scale, scale_inv } => write!(
                f,
                "has two scales, `{}` and `{}`: which one it is dequantized with is ambiguous",
                esc(scale),
                esc(scale_inv)
            ),
            Fp8Problem::Dtype {
                weight,
                zero_point,
                dtype,
            } => write!(
                f,
                "is the {} of FP8 weight `{}` in {dtype}: stcast dequantizes with {}",
                role(*zero_point),
                esc(weight),
                if *zero_point {
                    "zero points in F8_E4M3, I8, I16 or I32"
                } else {
                    "scales in F32, BF16 or F16, E8M0 exponents in U8 (MXFP8's \
                     `weight_scale`, a scale per 32 columns) or an F8_E8M0 \
                     `weight_scale_inv` (transformers' FP8); compressed-tensors casts the \
                     codes to an F8_E8M0 `weight_scale`'s dtype, which no reference reads"
                }
            ),
            Fp8Problem::Shape {
                weight,
                zero_point: false,
                shape,
                expected: weight_shape,
            } => write!(
                f,
                "is the scale of FP8 weight `{}` {weight_shape:?} with shape {shape:?}, which \
                 is no per-tensor, per-channel, per-group or 128x128-block layout of it",
                esc(weight)
            ),
            Fp8Problem::Shape {
                weight,
                zero_point: true,
                shape,
                expected: scale_shape,
            } => write!(
                f,
                "is the zero point of FP8 weight `{}` with shape {shape:?}, not its scale's \
                 {scale_shape:?}",
                esc(weight)
            ),
            Fp8Problem::NotBeside { weight, zero_point } => write!(
                f,
                "is the {} of FP8 weight `{}` but is not stored whole beside it (a strided or \
                 big-endian view, pieces, or another file)",
                role(*zero_point),
                esc(weight)
            ),
            Fp8Problem::AmbiguousScale {
                weight,
                shape,
                expected: weight_shape,
            } => write!(
                f,
                "is the scale of one-row FP8 weight `{}` {weight_shape:?} with shape {shape:?}, \
                 which is both its 128x128-block layout and a per-group one of {} columns: \
                 which groups its columns is ambiguous",
                esc(weight),
                weight_shape.last().copied().unwrap_or(0)
                    / shape.last().copied().unwrap_or(1).max(1)
            ),
            Fp8Problem::Overflow { values, target } => write!(
                f,
                "has {} that would become ±inf in {} once dequantized, and its codes \
                 cannot be kept without the scale dequantization drops ({{on_overflow=keep}} \
                 keeps no dequantized weight; BF16 holds them)",
                crate::text::count(*values, "value"),
                target.describe()
            ),
            Fp8Problem::Pattern {
                config,
                pattern,
                reason,
            } => write!(
                f,
                "is a packed weight whose config {} has the pattern `{}`, which stcast \
                 cannot match as compressed-tensors (Python's re) does: {}",
                esc_path(config),
                esc(pattern),
                esc(reason)
            ),
            Fp8Problem::Kept { pattern } => write!(
                f,
                "is matched by the {{keep}} pattern `{}`, but it is a quantized weight or what \
                 dequantizes one: its codes cannot be kept without the scales dequantization \
                 drops, and the output's config has no quantization_config to describe them",
                esc(pattern)
            ),
            Fp8Problem::NameTaken { out, other } => write!(
                f,
                "is dequantized as `{}`, the name `{}` has in the output too (one name, two \
                 tensors)",
                esc(out),
                esc(other)
            ),
            Fp8Problem::Packed { format, detail } => write!(
                f,
                "is a {format} tensor stcast does not dequantize: {}",
                esc(detail)
            ),
            Fp8Problem::Config {
                format,
                config,
                says,
                holds,
            } => write!(
                f,
                "is a {format} weight whose config {} says {}, but its tensors hold {} \
                 (a config that does not describe its tensors)",
                esc_path(config),
                esc(says),
                esc(holds)
            ),
            Fp8Problem::ZeroPointWithScaleInv { weight, scale_inv } => write!(
                f,
                "is a zero point of FP8 weight `{}`, whose scale `{}` is DeepSeek's \
                 `weight_scale_inv`, a format without zero points",
                esc(weight),
                esc(scale_inv)
            ),
        }
    }
}

impl fmt::Display for DistProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DistProblem::Metadata { what } => write!(
                f,
                "not a torch.distributed.checkpoint .metadata: {}",
                esc(what)
            ),
            DistProblem::Transformed { descriptors } => write!(
                f,
                "stored through the transforms {}; stcast reads untransformed items only",
                name_list(descriptors.iter().map(String::as_str), 3)
            ),
            DistProblem::ItemFile { file, reason } => {
                write!(f, "its item file `{}`: {}", esc(file), esc(reason))
            }
            DistProblem::PastEnd { file, end, len } => write!(
                f,
                "its item ends at byte {end} of `{}`, past the file's {len} bytes",
                esc(file)
            ),
            DistProblem::Item {
                file,
                offset,
                reason,
            } => write!(
                f,
                "its item at byte {offset} of `{}`: {}",
                esc(file),
                esc(reason)
            ),
            DistProblem::Chunks { reason } => {
                write!(f, "its chunks do not make the tensor: {}", esc(reason))
            }
            DistProblem::Shard { what } => write!(
                f,
                "not a shard of torch.distributed.checkpoint's HuggingFaceStorageWriter: {}",
                esc(what)
            ),
            DistProblem::Zero { what } => write!(
                f,
                "not a consistent DeepSpeed ZeRO checkpoint: {}",
                esc(what)
            ),
            DistProblem::ZeroUnsupported { what } => write!(
                f,
                "{} is not supported: stcast reads ZeRO checkpoints of data-parallel ranks (one \
                 model-parallel rank); consolidate it with DeepSpeed's own tools",
                esc(what)
            ),
            DistProblem::ZeroKey { key } => write!(
                f,
                "{{key}} `{}` does not apply: a DeepSpeed ZeRO checkpoint holds one state dict, \
                 named as zero_to_fp32 names it (leave {{key}} out; {{strip_prefix}} applies)",
                esc(key)
            ),
            DistProblem::RankFile { what, folder } => write!(
                f,
                "{}, not a model on its own: convert the checkpoint folder `{}`",
                esc(what),
                esc(&folder.display().to_string())
            ),
        }
    }
}

/// Everything that can stop the engine.
#[derive(Debug)]
pub enum Error {
    /// The input is a folder, a FIFO, a device...: `what` says which.
    NotAFile { path: PathBuf, what: &'static str },
    /// The safetensors header is invalid; `reason` is the crate's, with specifics added.
    InvalidHeader { path: PathBuf, reason: String },
    /// The file is another format (a GGUF file, an HTML page, ...), not one stcast reads
    /// there (a PyTorch checkpoint where only safetensors will do: the side verify reads).
    OtherFormat { path: PathBuf, format: Format },
    /// No tensor would change: the output would be a copy of the input.
    NothingToConvert {
        path: PathBuf,
        target: Target,
        /// BF16 tensors are copied (fp16 without `from_bf16`): the way out is that option.
        bf16_copied: bool,
    },
    /// A PyTorch checkpoint that cannot be read, is refused (a global outside the
    /// allow-list, a tensor safetensors cannot hold), or whose state dict must be chosen.
    Checkpoint { path: PathBuf, error: TorchError },
    /// An option for PyTorch checkpoints (`key`, `strip_prefix`) given for another input.
    NotACheckpoint {
        path: PathBuf,
        option: OptionName,
        /// What the input is: `Safetensors`, `DcpSafetensors`.
        format: crate::format::Format,
    },
    /// A distributed training checkpoint (a DCP folder) that cannot be read as it says:
    /// `path` is the file at fault (`.metadata`, a `.distcp` file).
    Distributed {
        path: PathBuf,
        tensor: Option<String>,
        problem: DistProblem,
    },
    /// The input was written to, truncated or extended while it was read.
    InputChanged { path: PathBuf, change: String },
    /// The planned output header would pass the format's limit.
    OutputHeaderTooLarge { path: PathBuf, limit: usize },
    /// A `keep` pattern is not a valid fnmatch pattern.
    BadPattern {
        option: OptionName,
        pattern: String,
        reason: String,
    },
    /// `keep` patterns that match no tensor name, under the `strict` option.
    UnmatchedPatterns {
        path: PathBuf,
        patterns: Vec<String>,
    },
    /// Finite values would become infinite, under `on_overflow=error`.
    Overflow {
        path: PathBuf,
        target: Target,
        values: u64,
        tensors: usize,
        worst: String,
        worst_values: u64,
        /// How many of the `tensors` are dequantized weights, which have no dtype of their
        /// own to keep (`overflow_advice`).
        dequantized: usize,
    },
    /// A quantized checkpoint, without `allow_quantized` (`plan::quantized`): `why` (a
    /// template) says what makes it so, `tensors` are the F32 tensors that would change.
    Quantized {
        path: PathBuf,
        why: String,
        tensors: Vec<String>,
    },
    /// An FP8 target given a checkpoint that is quantized already (`plan::already_quantized`):
    /// `why` (a template) names the tensor, or the config, that makes it so. No option
    /// converts it: re-quantizing codes and scales would write a checkpoint that loads wrong.
    AlreadyQuantized { path: PathBuf, why: String },
    /// An FP8 target met NaN or inf in a weight it planned to quantize: the weights were
    /// read before planning (`ConvertTask`), so the input changed since.
    NonFiniteWeight { path: PathBuf, tensor: String },
    /// An FP8 checkpoint being dequantized holds a tensor it cannot dequantize as
    /// compressed-tensors would (`problem` says why): a quantized tensor without a scale, a
    /// scale or zero point without its weight, or one whose form stcast cannot prove exact.
    Fp8Unpaired {
        path: PathBuf,
        tensor: String,
        problem: Box<Fp8Problem>,
    },
    /// SRC cannot be read as DST's record of convert's options says (its `key` or
    /// `strip_prefix`), though it can be read without: DST's content is at fault, not the
    /// caller's options (`problem`: what reading SRC so met).
    Recorded { path: PathBuf, problem: Box<Error> },
    /// `name` (one output's stem) given for a source of `count` checkpoints (groups), the
    /// first of them `shown` (each by its index, else its file).
    NamedMany { count: usize, shown: Vec<PathBuf> },
    /// Two things a re-sharding writes (`first`, `second`: what, in words) would be the
    /// output `path`: outputs are named after their input's stem.
    OutputsCollide {
        path: PathBuf,
        first: String,
        second: String,
    },
    /// A group re-sharded into several shards whose stem (of its first input file `path`,
    /// `name` in the source) is not UTF-8: no index (JSON) can name its shards.
    StemNotUtf8 { path: PathBuf, name: PathBuf },
    /// A plain folder run (of `path`) that converts no tensor of any file and changes no
    /// file's format: its output would be a copy of the folder.
    FolderUnchanged { path: PathBuf, target: Target },
    /// The shards a re-sharding wrote hold `written` tensor bytes, its index (`path`) plans
    /// `planned`.
    IndexTotal {
        path: PathBuf,
        written: u64,
        planned: u64,
    },
    /// `finalize`: a shard run's manifest (`path`) says `says` shards, but the source `src`
    /// has only `units` of the run's units (`noun`: "weight files", "output shards").
    ShardCount {
        path: PathBuf,
        says: usize,
        src: PathBuf,
        units: usize,
        noun: &'static str,
    },
    /// `finalize`: a unit of the run is not there as a shard run wrote it: `path` is the
    /// input of a whole file (`written` false: not converted), else the output shard (not
    /// written); `shard`, the shard run that converts it, when the manifests tell.
    UnitMissing {
        path: PathBuf,
        written: bool,
        shard: Option<(usize, usize)>,
    },
    /// An option's value is out of range.
    BadOption {
        option: OptionName,
        value: String,
        expected: String,
    },
    /// `shard` I/N (`given`) splits a run into more shard runs than it has units (`max`,
    /// `noun`: what they are).
    ShardRange {
        given: String,
        max: usize,
        noun: &'static str,
    },
    /// An option given for a run it does not apply to (`given::check_applies`): `src` is
    /// the run's source, `why` what the run is instead.
    NotApplicable {
        option: OptionName,
        src: PathBuf,
        why: Inapplicable,
    },
    /// The destination's folder does not exist, or is not a folder.
    NoDestinationFolder { dir: PathBuf, exists: bool },
    /// The destination is the input file itself.
    DestinationIsInput { path: PathBuf },
    /// An output (`role`) would lie inside a folder of the source (or of the destination,
    /// for a side output): it would become part of that checkpoint, or replace a file of it.
    InsideFolder {
        path: PathBuf,
        role: Side,
        folder: PathBuf,
        taken: Taken,
    },
    /// A symlink among a checkpoint's files leads outside its folder (and not into a Hugging
    /// Face cache's `blobs/`): not followed unless asked (`{follow_links}`).
    LinkOutside {
        link: PathBuf,
        target: PathBuf,
        folder: bool,
    },
    /// A source folder's walk found what it refuses (`WalkProblem`).
    Walk { path: PathBuf, problem: WalkProblem },
    /// A model config given for a lone file's output (`convert::Options::model_config`) that
    /// is not one: `reason` says why.
    BadConfig { path: PathBuf, reason: &'static str },
    /// A config beside a lone output that would describe the weights written wrongly, and
    /// that the run would leave as it is (`beside::problem`: `why`).
    /// `folder`: the run writes no config there (a folder run's; an FP8 side config stcast
    /// did not write, beside a dense run's output).
    WrongConfig {
        path: PathBuf,
        why: String,
        folder: bool,
    },
    /// An index that is not one, names shards it may not (`refused`), or disagrees with
    /// the shards written (`run::check`): `why` (a template) says how.
    BadIndex {
        path: PathBuf,
        why: String,
        refused: bool,
    },
    /// A config of a source folder that a folder run cannot plan with (`ConfigProblem`).
    FolderConfig {
        path: PathBuf,
        problem: ConfigProblem,
    },
    /// Where a folder run reads or writes is refused (`PlaceProblem`).
    Place {
        path: PathBuf,
        problem: PlaceProblem,
    },
    /// A folder run's manifests refuse it (`ManifestProblem`).
    Manifest {
        path: PathBuf,
        problem: ManifestProblem,
    },
    /// What the destination `dst` of a folder run holds refuses it (`SurveyProblem`); `path`
    /// is the first file named (or `dst`).
    Survey {
        dst: PathBuf,
        path: PathBuf,
        problem: SurveyProblem,
    },
    /// A DST to verify that is a checkpoint to convert (a DCP or ZeRO folder), not what
    /// `convert` writes: SRC and DST swapped, most likely.
    NotAnOutput { path: PathBuf, format: Format },
    /// The destination is a folder.
    DestinationIsFolder { path: PathBuf },
    /// The destination is a FIFO, socket or device (or a link to one): never replaced.
    DestinationIsSpecial { path: PathBuf },
    /// The destination exists and may not be replaced.
    DestinationExists { path: PathBuf },
    /// A file stcast would replace is not (or no longer) the one it wrote.
    NotOurs { path: PathBuf },
    /// A side output (the numeric report) would be written over an input or the output,
    /// or where no regular file can be: `what` says which.
    SideOutput {
        path: PathBuf,
        role: &'static str,
        what: &'static str,
    },
    /// The same file was given as source and destination of a comparison.
    SameFile { path: PathBuf },
    /// The output was published (the commit point), then a later step failed.
    AfterCommit {
        published: PathBuf,
        source: Box<Error>,
        /// A folder run's (its numeric report failed): a refusal about the folder.
        folder: bool,
    },
    /// The destination's file system cannot hold the output (`folder`: a folder run's).
    NoSpace {
        dir: PathBuf,
        need: u64,
        have: u64,
        folder: bool,
    },
    /// An operating-system call failed; `what` says which step.
    Io {
        path: PathBuf,
        what: &'static str,
        source: io::Error,
    },
    /// The caller asked us to stop (a cancel flag, a failing callback).
    Cancelled,
}

pub type Result<T> = std::result::Result<T, Error>;

/// What a run is, where an option it was given does not apply (`Error::NotApplicable`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inapplicable {
    /// Nothing is re-sharded (`name` without `max_shard_size`).
    NotResharded,
    /// SRC is one checkpoint, not a folder of files (`include`, `exclude`).
    NotAFolderOfFiles,
    /// SRC is a folder of files (`key`: one checkpoint's; `config`: a lone checkpoint's).
    FolderOfFiles,
    /// The run writes some shards of the output only (`config`).
    InShards,
    /// SRC is one checkpoint folder (DCP, ZeRO), written as one file (`resume`, `shard`).
    OneFile,
    /// SRC is a file, not a folder (`resume`, `shard`).
    NotAFolder,
    /// verify: DST is a file, where `name` names a re-sharded folder's files.
    FileDst,
}

impl Error {
    pub fn io(path: &Path, what: &'static str, source: io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            what,
            source,
        }
    }

    pub fn invalid_header(path: &Path, reason: impl Into<String>) -> Self {
        Error::InvalidHeader {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    /// A `DistProblem` of file `path` (of tensor `tensor`, where one is concerned).
    pub fn distributed(path: &Path, tensor: Option<&str>, problem: DistProblem) -> Error {
        Error::Distributed {
            path: path.to_path_buf(),
            tensor: tensor.map(str::to_string),
            problem,
        }
    }

    /// The category: the Python exception class and the CLI's JSON `kind`.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidHeader { .. }
            | Error::BadConfig { .. }
            | Error::BadIndex { refused: false, .. }
            | Error::IndexTotal { .. }
            | Error::OtherFormat { .. }
            | Error::OutputHeaderTooLarge { .. }
            | Error::NonFiniteWeight { .. }
            | Error::Recorded { .. } => ErrorKind::InvalidInput,
            Error::NothingToConvert { .. } => ErrorKind::Refused,
            Error::Checkpoint { error, .. } => checkpoint_kind(error),
            Error::Distributed { problem, .. } => match problem {
                DistProblem::Transformed { .. } | DistProblem::ZeroUnsupported { .. } => {
                    ErrorKind::Refused
                }
                DistProblem::ZeroKey { .. } => ErrorKind::Usage,
                _ => ErrorKind::InvalidInput,
            },
            Error::Walk { problem, .. } => match problem {
                WalkProblem::BrokenLink => ErrorKind::InvalidInput,
                _ => ErrorKind::Refused,
            },
            Error::FolderConfig { problem, .. } => match problem {
                ConfigProblem::NotAnObject => ErrorKind::InvalidInput,
                ConfigProblem::Unread { .. } | ConfigProblem::SideTaken { .. } => {
                    ErrorKind::Refused
                }
            },
            Error::Place {
                problem: PlaceProblem::DstLikeFile { .. } | PlaceProblem::HoldsBoth { .. },
                ..
            } => ErrorKind::Usage,
            Error::Place {
                problem: PlaceProblem::HubRepo { .. },
                ..
            } => ErrorKind::InvalidInput,
            Error::Manifest {
                problem: ManifestProblem::Rival { .. },
                ..
            } => ErrorKind::DestinationExists,
            Error::Place { .. }
            | Error::Manifest { .. }
            | Error::Survey { .. }
            | Error::BadIndex { refused: true, .. } => ErrorKind::Refused,
            Error::NotACheckpoint { .. } => ErrorKind::Usage,
            Error::InputChanged { .. } => ErrorKind::InputChanged,
            Error::NotAFile { .. }
            | Error::UnmatchedPatterns { .. }
            | Error::Overflow { .. }
            | Error::Quantized { .. }
            | Error::AlreadyQuantized { .. }
            | Error::Fp8Unpaired { .. }
            | Error::NoDestinationFolder { .. }
            | Error::DestinationIsInput { .. }
            | Error::InsideFolder { .. }
            | Error::LinkOutside { .. }
            | Error::NotAnOutput { .. }
            | Error::DestinationIsFolder { .. }
            | Error::DestinationIsSpecial { .. }
            | Error::NotOurs { .. }
            | Error::SideOutput { .. }
            | Error::WrongConfig { .. }
            | Error::SameFile { .. }
            | Error::OutputsCollide { .. }
            | Error::StemNotUtf8 { .. }
            | Error::FolderUnchanged { .. }
            | Error::ShardCount { .. }
            | Error::UnitMissing { .. } => ErrorKind::Refused,
            Error::AfterCommit { folder: true, .. } => ErrorKind::Refused,
            Error::AfterCommit { source, .. } => source.kind(),
            Error::BadPattern { .. }
            | Error::BadOption { .. }
            | Error::ShardRange { .. }
            | Error::NotApplicable { .. }
            | Error::NamedMany { .. } => ErrorKind::Usage,
            Error::DestinationExists { .. } => ErrorKind::DestinationExists,
            Error::NoSpace { .. } => ErrorKind::NoSpace,
            // A full disk is always `no_space`, whichever step found it.
            Error::Io { source, .. } if is_no_space(source) => ErrorKind::NoSpace,
            Error::Io { .. } => ErrorKind::Io,
            Error::Cancelled => ErrorKind::Cancelled,
        }
    }

    /// The file (or folder) the error is about, if any.
    pub fn path(&self) -> Option<&Path> {
        match self {
            Error::NotAFile { path, .. }
            | Error::InvalidHeader { path, .. }
            | Error::BadConfig { path, .. }
            | Error::BadIndex { path, .. }
            | Error::OtherFormat { path, .. }
            | Error::NothingToConvert { path, .. }
            | Error::Checkpoint { path, .. }
            | Error::Distributed { path, .. }
            | Error::NotACheckpoint { path, .. }
            | Error::InputChanged { path, .. }
            | Error::OutputHeaderTooLarge { path, .. }
            | Error::UnmatchedPatterns { path, .. }
            | Error::Overflow { path, .. }
            | Error::Quantized { path, .. }
            | Error::AlreadyQuantized { path, .. }
            | Error::Fp8Unpaired { path, .. }
            | Error::NonFiniteWeight { path, .. }
            | Error::DestinationIsInput { path }
            | Error::InsideFolder { path, .. }
            | Error::NotAnOutput { path, .. }
            | Error::LinkOutside { link: path, .. }
            | Error::Walk { path, .. }
            | Error::FolderConfig { path, .. }
            | Error::Place { path, .. }
            | Error::Manifest { path, .. }
            | Error::Survey { path, .. }
            | Error::DestinationIsFolder { path }
            | Error::DestinationIsSpecial { path }
            | Error::DestinationExists { path }
            | Error::NotOurs { path }
            | Error::SideOutput { path, .. }
            | Error::WrongConfig { path, .. }
            | Error::SameFile { path }
            | Error::OutputsCollide { path, .. }
            | Error::StemNotUtf8 { path, .. }
            | Error::FolderUnchanged { path, .. }
            | Error::IndexTotal { path, .. }
            | Error::ShardCount { path, .. }
            | Error::UnitMissing { path, .. }
            | Error::Recorded { path, .. }
            | Error::Io { path, .. } => Some(path),
            Error::AfterCommit {
                folder: true,
                published,
                ..
            } => Some(published),
            Error::AfterCommit { source, .. } => source.path(),
            Error::NoDestinationFolder { dir, .. } | Error::NoSpace { dir, .. } => Some(dir),
            Error::BadPattern { .. }
            | Error::BadOption { .. }
            | Error::ShardRange { .. }
            | Error::NotApplicable { .. }
            | Error::NamedMany { .. }
            | Error::Cancelled => None,
        }
    }

    /// The tensor the error is about, if one is.
    pub fn tensor(&self) -> Option<&str> {
        match self {
            Error::Overflow { worst, .. } => Some(worst),
            Error::Distributed {
                tensor: Some(t), ..
            } => Some(t),
            Error::Checkpoint {
                error:
                    TorchError::Tensor { name, .. }
                    | TorchError::PlaceholderValue { name, .. }
                    | TorchError::DuplicateName { name, .. },
                ..
            } => Some(name),
            _ => None,
        }
    }

    /// The option the error is about, for usage errors.
    pub fn option(&self) -> Option<OptionName> {
        match self {
            Error::BadOption { option, .. } | Error::NotApplicable { option, .. } => Some(*option),
            Error::BadPattern { option, .. } => Some(*option),
            Error::NotACheckpoint { option, .. } => Some(*option),
            Error::NamedMany { .. } => Some(OptionName::Name),
            Error::ShardRange { .. } => Some(OptionName::Shard),
            Error::Place {
                problem:
                    PlaceProblem::DstLikeFile {
                        resharding: true, ..
                    },
                ..
            } => Some(OptionName::MaxShardSize),
            Error::Place {
                problem: PlaceProblem::HoldsBoth { .. },
                ..
            } => Some(OptionName::To),
            Error::Distributed {
                problem: DistProblem::ZeroKey { .. },
                ..
            } => Some(OptionName::Key),
            _ => None,
        }
    }

    /// The OS error number behind the error, if any (`ENOSPC` for a full disk).
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::AfterCommit { folder: true, .. } => None,
            Error::AfterCommit { source, .. } => source.errno(),
            Error::Io { source, .. } => source.raw_os_error(),
            Error::NoSpace { .. } => Some(libc::ENOSPC),
            Error::DestinationExists { .. } => Some(libc::EEXIST),
            _ => None,
        }
    }

    /// The message without the path: one line, a template (see `text`).
    pub fn message(&self) -> String {
        match self {
            Error::NotAFile { what, .. } => format!("input is {what}, not a regular file"),
            Error::InvalidHeader { reason, .. } => {
                format!("invalid safetensors file: {}", esc(reason))
            }
            Error::BadConfig { reason, .. } => format!("not a model config: {reason}"),
            Error::WrongConfig { why, folder, .. } => format!(
                "{}: it would describe the weights written beside it wrongly ({})",
                esc(why),
                match folder {
                    false =>
                        "give the output's model config with {config} to replace it, or \
                              remove it",
                    true =>
                        "this run writes no config there: remove it, or convert into an \
                             empty folder",
                }
            ),
            Error::BadIndex { why, .. } => why.clone(),
            Error::OtherFormat { format, .. } => match format {
                Format::TorchZip | Format::TorchLegacy | Format::Dcp | Format::DcpSafetensors => {
                    format!("{}, not a safetensors file", format.describe())
                }
                // Read as a source (`input::zero`); named so where only safetensors will do.
                Format::DeepSpeed => format!(
                    "{}: a checkpoint to convert (a SRC), not a safetensors file",
                    format.describe()
                ),
                _ => format!(
                    "{}, not a safetensors file or a PyTorch checkpoint",
                    format.describe()
                ),
            },
            Error::NothingToConvert {
                target,
                bf16_copied,
                ..
            } => match target.dtype() {
                Some(dtype) => format!(
                    "nothing to convert: no tensor becomes {dtype} ({}); the output would be a \
                     copy of the input",
                    if *bf16_copied {
                        "its BF16 tensors are copied as they are unless {from_bf16}"
                    } else {
                        "each float tensor already is, or is kept"
                    }
                ),
                None => "nothing to convert: the input is a safetensors file already and \
                         {to=keep} keeps every dtype; the output would be a copy of the input"
                    .to_string(),
            },
            Error::Checkpoint { error, .. } => checkpoint_message(error),
            Error::Distributed {
                tensor, problem, ..
            } => match tensor {
                Some(t) => format!("tensor `{}`: {problem}", esc(t)),
                None => problem.to_string(),
            },
            Error::NotACheckpoint { option, format, .. } => format!(
                "{{{}}} applies to PyTorch checkpoints (.bin, .pt, .pth), and this is {}",
                option.name(),
                match format {
                    crate::format::Format::DcpSafetensors => {
                        "a folder of the safetensors shards that torch.distributed.checkpoint's \
                         HuggingFaceStorageWriter writes (one state dict, its tensors named as \
                         saved)"
                    }
                    _ => "a safetensors file",
                }
            ),
            Error::InputChanged { change, .. } => format!(
                "input changed while being read ({}); no output was written",
                esc(change)
            ),
            Error::OutputHeaderTooLarge { limit, .. } => {
                format!("output header would exceed {limit} bytes")
            }
            Error::BadPattern {
                option,
                pattern,
                reason,
            } => format!(
                "{{{}}}: invalid pattern `{}`: {}",
                option.name(),
                esc(pattern),
                esc(reason)
            ),
            Error::UnmatchedPatterns { patterns, .. } => format!(
                "{}; nothing was written ({{strict}} makes this an error)",
                unmatched_message(patterns)
            ),
            Error::Overflow {
                target,
                values,
                tensors,
                worst,
                worst_values,
                dequantized,
                ..
            } => format!(
                "{} in {} would become ±inf in {}, most in tensor `{}` ({worst_values}); \
                 nothing was written ({})",
                count(*values, "finite value"),
                count(*tensors as u64, "tensor"),
                target.describe(),
                esc(worst),
                overflow_advice(*dequantized, *tensors)
            ),
            Error::NonFiniteWeight { tensor, .. } => format!(
                "tensor `{}` holds NaN or inf, which the read of the weights before planning \
                 did not find (was the source changed during the run?)",
                esc(tensor)
            ),
            Error::Fp8Unpaired {
                tensor, problem, ..
            } => format!(
                "tensor `{}` {problem}: this quantized checkpoint cannot be dequantized whole; \
                 nothing was written",
                esc(tensor)
            ),
            Error::AlreadyQuantized { why, .. } => format!(
                "already quantized ({why}): an FP8 target quantizes F32, F16 and BF16 \
                 weights, not a quantized checkpoint"
            ),
            // `*scale*` is suggested only where it keeps the tensors named (`plan::quantized`
            // names the scale-like ones, else every F32 one): never a pattern matching none.
            Error::Quantized { why, tensors, .. } => {
                let scales = tensors
                    .iter()
                    .all(|t| t.to_ascii_lowercase().contains("scale"));
                format!(
                    "quantized checkpoint ({why}): converting it would silently round its F32 \
                     {} too ({}); nothing was written (keep them with {}, or convert anyway \
                     with {{allow_quantized}})",
                    if scales { "scale tensors" } else { "tensors" },
                    name_list(tensors.iter().map(String::as_str), 3),
                    if scales {
                        "{keep=*scale*}"
                    } else {
                        "{keep} patterns naming them"
                    }
                )
            }
            Error::BadOption {
                option,
                value,
                expected,
            } => format!(
                "{{{}}}: {} is not {}",
                option.name(),
                esc(value),
                esc(expected)
            ),
            Error::ShardRange { given, max, noun } => format!(
                "{{shard}}: '{}' is not I/N with N at most {max}, the number of {noun}",
                esc(given)
            ),
            Error::NamedMany { count, shown } => {
                let listed: Vec<String> =
                    shown.iter().map(|p| format!("`{}`", esc_path(p))).collect();
                let more = match count.saturating_sub(shown.len()) {
                    0 => String::new(),
                    n => format!(" and {n} more"),
                };
                format!(
                    "{{name}} names the output of one checkpoint, but SRC holds {count} \
                     ({}{more}); leave it out (each keeps its own stem), or convert them one at \
                     a time",
                    listed.join(", ")
                )
            }
            Error::NotApplicable { option, src, why } => {
                let (o, src) = (option.name(), esc_path(src));
                match why {
                    Inapplicable::NotResharded => format!(
                        "{{{o}}} names the files of a re-sharded output: it applies with \
                         {{max_shard_size}}"
                    ),
                    Inapplicable::NotAFolderOfFiles => format!(
                        "{{{o}}} applies to a folder of files (what it copies beside its \
                         weights): {src} is one checkpoint"
                    ),
                    Inapplicable::FolderOfFiles if *option == OptionName::Key => format!(
                        "{{{o}}} applies to PyTorch checkpoint files; {src} is a folder of files"
                    ),
                    Inapplicable::FolderOfFiles | Inapplicable::InShards => format!(
                        "{{{o}}} applies to a lone checkpoint (a file, a DCP or ZeRO folder) \
                         written in one run: {src} is {}",
                        if *why == Inapplicable::InShards {
                            "converted in shards ({shard})"
                        } else {
                            "a folder of files"
                        }
                    ),
                    Inapplicable::OneFile => format!(
                        "{{{o}}} applies to an output of several files: {src} is one \
                         checkpoint, written as one file; give {{max_shard_size}} to split it"
                    ),
                    Inapplicable::NotAFolder => {
                        format!("{{{o}}} applies to folders; {src} is not one")
                    }
                    Inapplicable::FileDst => format!(
                        "{{{o}}} names the files of a re-sharded checkpoint: it applies to a \
                         DST folder"
                    ),
                }
            }
            Error::NoDestinationFolder { exists, .. } => if *exists {
                "destination folder is not a folder"
            } else {
                "destination folder does not exist"
            }
            .to_string(),
            Error::DestinationIsInput { .. } => "destination is the input file".into(),
            Error::InsideFolder {
                role,
                folder,
                taken,
                ..
            } => {
                let what = match role {
                    Side::Output => "destination".to_string(),
                    other => format!("{} path", other.name()),
                };
                match taken {
                    Taken::Input => format!(
                        "the {what} lies inside the checkpoint folder {}, whose files are the \
                         input: write it elsewhere{}",
                        esc_path(folder),
                        if *role == Side::Output {
                            " (DST left out goes beside the folder)"
                        } else {
                            ""
                        }
                    ),
                    Taken::Output => format!(
                        "the {what} lies inside the destination folder {}: write it elsewhere",
                        esc_path(folder)
                    ),
                }
            }
            Error::NotAnOutput { format, .. } => format!(
                "DST is {}: a checkpoint to convert, not a conversion output (verify takes the \
                 checkpoint as SRC, then what convert wrote as DST: were they swapped?)",
                format.describe()
            ),
            Error::LinkOutside { target, folder, .. } => format!(
                "a symlink to {} outside the source folder ({}); stcast follows links only \
                 within the source and into a Hugging Face cache's blobs/ ({{follow_links}} \
                 follows it)",
                if *folder { "a folder" } else { "a file" },
                esc_path(target)
            ),
            Error::Walk { problem, .. } => walk_message(problem),
            Error::FolderConfig { problem, .. } => config_message(problem),
            Error::Place { problem, .. } => place_message(problem),
            Error::Manifest { problem, .. } => manifest_message(problem),
            Error::Survey { problem, .. } => survey_message(problem),
            Error::DestinationIsFolder { .. } => "destination is a folder".into(),
            Error::DestinationIsSpecial { .. } => {
                "destination is not a regular file (a FIFO, socket or device): stcast \
                 replaces only regular files"
                    .into()
            }
            Error::DestinationExists { .. } => "destination exists ({force} replaces it)".into(),
            Error::NotOurs { .. } => "exists, and is not the file stcast wrote there (it was \
                 replaced or changed since); stcast does not replace what it did not write \
                 ({force} does)"
                .into(),
            Error::SideOutput { role, what, .. } => format!("the {role} {what}"),
            Error::SameFile { .. } => "SRC and DST are the same file".into(),
            Error::OutputsCollide { first, second, .. } => format!(
                "both {} and {} would be written there; re-sharding names outputs after their \
                 input's stem, and these two share one (convert them into separate folders)",
                esc(first),
                esc(second)
            ),
            Error::FolderUnchanged { target, .. } => nothing_to_convert(*target),
            Error::IndexTotal {
                written, planned, ..
            } => format!(
                "the shards written hold {written} tensor bytes, the plan {planned} (was the \
                 source changed during the run?)"
            ),
            Error::ShardCount {
                says,
                src,
                units,
                noun,
                ..
            } => format!(
                "says {says} shards, but {} has {units} {noun}; convert the shards again",
                esc_path(src)
            ),
            Error::UnitMissing { written, shard, .. } => {
                let what = if *written {
                    "not written"
                } else {
                    "not converted"
                };
                let hint = match shard {
                    Some((i, n)) => format!("; convert it again with {{shard={i}/{n}}}"),
                    None => String::new(),
                };
                format!("{what}, or changed since{hint}")
            }
            Error::StemNotUtf8 { .. } => "its name is not UTF-8, so an index (JSON) cannot name \
                                          the shards cut from it; rename it, or name the output \
                                          with {name}"
                .into(),
            // The options named as the record names them, not as a caller gives them.
            Error::Recorded { problem, .. } => format!(
                "SRC cannot be read as its stcast record says: {}",
                esc(&plain(&problem.template()))
            ),
            Error::AfterCommit {
                published, source, ..
            } => format!(
                "{} was published, but then {}",
                esc_path(published),
                source.template()
            ),
            Error::NoSpace {
                need, have, folder, ..
            } => format!(
                "not enough disk space{}: need {}, have {}",
                if *folder { " for the whole folder" } else { "" },
                format_bytes(*need),
                format_bytes(*have)
            ),
            Error::Io { what, source, .. } => {
                let text = source.to_string();
                // std appends " (os error N)"; the errno is carried separately.
                let text = text.split(" (os error").next().unwrap_or(&text);
                format!("{what}: {}", esc(text))
            }
            Error::Cancelled => "cancelled".into(),
        }
    }

    /// The whole one-line text, `path: message`, as a template.
    pub fn template(&self) -> String {
        if let Error::AfterCommit { .. } = self {
            return self.message();
        }
        if let Error::Survey { dst, .. } = self {
            return format!("{}: {}", esc_path(dst), self.message());
        }
        // (Named as the source names it; `path` is the file.)
        if let Error::StemNotUtf8 { name, .. } = self {
            return format!("{}: {}", esc_path(name), self.message());
        }
        match self.path() {
            Some(p) => format!("{}: {}", esc_path(p), self.message()),
            None => self.message(),
        }
    }
}

/// Why a folder run that converts no tensor of any file (and changes no file's format) is
/// refused: its output would be a copy of the folder (`verify` fails such a DST too).
pub fn nothing_to_convert(to: Target) -> String {
    let why = match to.dtype() {
        Some(dtype) if to != Target::Keep => format!(
            "no tensor of any file becomes {dtype} (each float tensor already is, or is kept)"
        ),
        _ => "the folder's weights are safetensors files already and {to=keep} keeps every \
              dtype"
            .into(),
    };
    format!("nothing to convert: {why}; the output would be a copy of the folder")
}

/// The text of a `SurveyProblem`, after the destination.
fn survey_message(problem: &SurveyProblem) -> String {
    // The first `n` files named, and how many more there are.
    let listed = |rels: &[std::ffi::OsString], n: usize| {
        let shown: Vec<String> = rels
            .iter()
            .take(n)
            .map(|r| format!("`{}`", esc(&r.to_string_lossy())))
            .collect();
        let more = if rels.len() > n {
            format!(" and {} more", rels.len() - n)
        } else {
            String::new()
        };
        shown.join(", ") + &more
    };
    match problem {
        SurveyProblem::Unproven {
            listed: rels,
            resume,
            finalize,
        } => format!(
            "holds {}, which this run would write, and no stcast manifest says it wrote them \
             there ({})",
            listed(rels, 3),
            if *finalize {
                "remove them, or run the shard runs again with {force}, which replaces them"
            } else if *resume {
                "{force} replaces them"
            } else {
                "{resume} continues a run of this source, or takes over a finished one's exact \
                 outputs; {force} replaces them"
            }
        ),
        SurveyProblem::Foreign { listed: rels } => format!(
            "the destination folder holds files stcast did not write ({}); convert into an \
             empty or new folder ({{force}} writes into it anyway, replacing only what the plan \
             writes)",
            listed(rels, 3)
        ),
        SurveyProblem::Leftovers { listed: rels } => {
            let many = rels.len() != 1;
            let them = if many { "them" } else { "it" };
            format!(
                "holds {}, named as {} of this checkpoint's output that this run does not \
                 write; a loader would load {them} with or instead of the new output, and no \
                 stcast manifest proves {them} stcast's (a finished run leaves none): remove \
                 {them}, or convert into an empty folder",
                listed(rels, 4),
                if many { "files" } else { "a file" }
            )
        }
    }
}

/// The text of a `ManifestProblem`, after its path.
fn manifest_message(problem: &ManifestProblem) -> String {
    match problem {
        ManifestProblem::Unreadable {
            reason,
            finalize: false,
        } => format!(
            "{}; stcast cannot tell what it wrote here ({{force}} converts everything again and \
             replaces what the plan writes)",
            esc(reason)
        ),
        ManifestProblem::Unreadable {
            reason,
            finalize: true,
        } => format!("{}; convert the shards again", esc(reason)),
        ManifestProblem::OtherSource { src } => format!(
            "a stcast run of another source ({}) converts into this folder ({{force}} replaces \
             what this plan writes)",
            esc_path(src)
        ),
        ManifestProblem::Stopped { name, shard } => format!(
            "{} (its manifest {} records the files it finished); {{resume}} continues it, \
             {{force}} converts everything again",
            if *shard {
                "this shard already ran here"
            } else {
                "a previous run of this source stopped here before it finished"
            },
            esc(name)
        ),
        ManifestProblem::ShardRuns => "shard runs of this source convert into this folder; \
             `finalize` completes them ({resume} or {force} converts the whole folder)"
            .into(),
        ManifestProblem::OtherOptions => "shard runs with other options convert into this \
             folder ({force} replaces what this plan writes)"
            .into(),
        ManifestProblem::TakenOver { dst } => format!(
            "another stcast run took {} over while this one ran (it replaced or removed this \
             run's manifest, as {{force}}, {{resume}} and `finalize` do with a stopped run's); \
             this run stopped there, leaving the folder to that run (run again once it is \
             done, if need be)",
            esc_path(dst)
        ),
        ManifestProblem::StartedMeanwhile { dst } => format!(
            "another stcast run started converting into {} after this one checked it; nothing \
             was written (run again once it is done)",
            esc_path(dst)
        ),
        ManifestProblem::Rival { dst } => format!(
            "destination exists: another stcast run (or another program) wrote it after this \
             run checked {}; this run replaced nothing of it and stopped (run again once that \
             run is done)",
            esc_path(dst)
        ),
        ManifestProblem::Changed => "was replaced or removed during the run; run it again".into(),
        ManifestProblem::NoFolder => {
            "no such folder; convert the shards into it first (with {shard})".into()
        }
        ManifestProblem::NothingToFinalize => "no stcast manifest of this source: nothing to \
             finalize (already finalized, or not converted with {shard}: convert the shards \
             into it first)"
            .into(),
        ManifestProblem::Unfinished { shard } => {
            let (which, again) = match shard {
                None => ("a whole-folder run".to_string(), "{resume}".to_string()),
                Some((i, n)) => (
                    format!("shard {i}/{n}"),
                    format!("{{shard={i}/{n}}} {{resume}}"),
                ),
            };
            format!(
                "{which} has not finished (it is still running, or it stopped); wait for it, or \
                 run it again with {again}"
            )
        }
        ManifestProblem::Disagree { listed } => format!(
            "the manifests disagree on the options ({}); convert the shards again with the \
             same options",
            esc(listed)
        ),
        ManifestProblem::BadSize { value } => format!(
            "the manifests give max_shard_size {}, not a size; convert the shards again",
            esc(value)
        ),
        ManifestProblem::BadName { value } => format!(
            "the manifests give name {}, not a file name stem; convert the shards again",
            esc(value)
        ),
    }
}

/// The text of a `PlaceProblem`, after its path.
fn place_message(problem: &PlaceProblem) -> String {
    match problem {
        PlaceProblem::Missing { folder } => {
            format!("no such {}", if *folder { "folder" } else { "file" })
        }
        PlaceProblem::NotAFolder { file: false } => "not a folder".into(),
        PlaceProblem::NotAFolder { file: true } => "not a regular file".into(),
        PlaceProblem::DstNotAFolder { resharding } => format!(
            "exists and is not a folder{}",
            if *resharding {
                " (re-sharding writes a folder)"
            } else {
                ""
            }
        ),
        PlaceProblem::DstLikeFile { resharding, folder } => format!(
            "{}, not one file: name a folder (e.g. {}/)",
            if *resharding {
                "{max_shard_size} writes a folder of shards and an index"
            } else {
                "the source is a folder of files, converted into a folder"
            },
            esc_path(folder)
        ),
        PlaceProblem::InTheWay => {
            "exists and is not a folder (stcast does not write through links)".into()
        }
        PlaceProblem::DstInSource => {
            "the destination is the source folder or lies inside it".into()
        }
        PlaceProblem::DstHoldsSource => "the destination contains the source folder".into(),
        PlaceProblem::VerifyDstNotAFolder { src } => {
            format!("not a folder, while {} is one", esc_path(src))
        }
        PlaceProblem::SameFolder => "SRC and DST are the same folder".into(),
        PlaceProblem::DstInCheckpoint { src } => format!(
            "the destination lies inside the checkpoint folder {}, whose files are the input: \
             write it elsewhere (DST left out goes beside the folder)",
            esc_path(src)
        ),
        PlaceProblem::OutputIsInput { input } => format!(
            "destination is the input file {} (the same file by device and inode: a hard link \
             or a symlink); nothing was written (convert into a folder that holds no links to \
             the source's files)",
            esc_path(input)
        ),
        PlaceProblem::OutputIsTheFile => {
            "this output would be the input file itself; re-shard into another folder".into()
        }
        PlaceProblem::OutputInSource => "is a folder of the source (by device and inode: a bind \
             mount or a link); nothing was written"
            .into(),
        PlaceProblem::HubRepo { repo } => format!(
            "no such file or folder; stcast converts local files: download it first, e.g. \
             `hf download {} --local-dir DIR`",
            esc(repo)
        ),
        PlaceProblem::HoldsBoth { first, second } => format!(
            "holds both {} and {}: name the file, or give {{to}}",
            esc_path(Path::new(first)),
            esc_path(Path::new(second))
        ),
        PlaceProblem::NoSnapshot { commit, snapshots } => format!(
            "names snapshot {}, which is not in {}",
            esc(commit),
            esc_path(snapshots)
        ),
        PlaceProblem::Snapshots { found, snapshots } => {
            let listed: Vec<String> = found.iter().map(|f| esc_path(Path::new(f))).collect();
            format!(
                "a Hugging Face cache repo without refs/main and with {} snapshots ({}); convert \
                 one of {}/<snapshot>",
                found.len(),
                if listed.is_empty() {
                    "none".into()
                } else {
                    listed.join(", ")
                },
                esc_path(snapshots)
            )
        }
    }
}

/// The text of a `WalkProblem`, after its path.
/// The text of a `ConfigProblem`, after the config's path.
fn config_message(problem: &ConfigProblem) -> String {
    match problem {
        ConfigProblem::SideTaken { rel } => format!(
            "is SRC's own, where this FP8 run writes the quantization_config of the weights \
             beside it (no model config there describes them): leave it out \
             ({{exclude={}}}), or give the folder its model config",
            esc(rel)
        ),
        ConfigProblem::NotAnObject => "not a JSON object, so an FP8 target cannot add its \
                                       quantization_config to it"
            .into(),
        ConfigProblem::Unread {
            key,
            method,
            detail,
        } => {
            let what = match method {
                Some(m) => format!("quant_method {m}"),
                None => "no quant_method".into(),
            };
            let detail = match detail.is_empty() {
                true => String::new(),
                false => format!(": {detail}"),
            };
            format!(
                "its {key} ({what}{detail}) is not a scheme stcast dequantizes \
                 (compressed-tensors float 8-bit or a packed format holding the weights it \
                 says, gpt-oss mxfp4, DeepSeek fp8), and the files hold quantized weights with \
                 scales: they are not dequantized under a config that would still call them \
                 quantized"
            )
        }
    }
}

fn walk_message(problem: &WalkProblem) -> String {
    match problem {
        WalkProblem::BrokenLink => "broken symlink".into(),
        WalkProblem::LinkInside { target } => format!(
            "a symlink to a folder inside the source folder ({}): its files would be written \
             twice, once under each name (remove the link, or convert a copy of the folder \
             without it)",
            esc_path(target)
        ),
        WalkProblem::Loop => "a symlink to a folder already walked (a loop)".into(),
        WalkProblem::NotRegular => "not a regular file".into(),
        WalkProblem::SameName { rel, other } => format!(
            "would be written as {}, as {} is",
            esc_path(rel),
            esc_path(other)
        ),
        WalkProblem::Incomplete {
            more,
            stem,
            total,
            pytorch,
        } => format!(
            "missing{}: the shards {}-*-of-{total} are incomplete (an interrupted download?){}; \
             nothing was written",
            if *more > 0 {
                format!(" (and {more} more)")
            } else {
                String::new()
            },
            esc(stem),
            if *pytorch {
                "; the PyTorch shards beside them are not used in their place (remove the \
                 safetensors ones to convert those)"
            } else {
                ""
            }
        ),
        WalkProblem::NoWeights => "a directory without .safetensors files or PyTorch weights \
                                   (pytorch_model*.bin): nothing to convert"
            .into(),
    }
}

/// A refusal on principle (code it would run, a state dict to choose) or a bad file.
fn checkpoint_kind(e: &TorchError) -> ErrorKind {
    match e {
        TorchError::Denied { .. }
        | TorchError::PlaceholderValue { .. }
        | TorchError::Ambiguous { .. }
        | TorchError::Tensor {
            problem: TensorProblem::CallsGlobal { .. } | TensorProblem::Subclass { .. },
            ..
        } => ErrorKind::Refused,
        _ => ErrorKind::InvalidInput,
    }
}

/// The reader's one line as a template; where it would name an option, a placeholder.
fn checkpoint_message(e: &TorchError) -> String {
    match e {
        TorchError::Ambiguous { candidates } => {
            let listed = candidates
                .iter()
                .take(8)
                .map(|(path, n)| format!("`{}` ({})", esc(path), count(*n as u64, "tensor")))
                .collect::<Vec<_>>()
                .join(", ");
            let more = candidates.len().saturating_sub(8);
            let more = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            // A concrete example where the first key can be written in one word.
            let example = candidates
                .first()
                .map(|(p, _)| p.as_str())
                .filter(|p| {
                    !p.is_empty() && !p.contains(|c: char| c.is_whitespace() || "{}'\"".contains(c))
                })
                .map_or_else(|| "{key}".to_string(), |p| format!("{{key={p}}}"));
            format!(
                "the checkpoint holds several dicts of tensors: {listed}{more}; choose one \
                 with {example}"
            )
        }
        other => esc(&other.to_string()).into_owned(),
    }
}

fn is_no_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// The one-line message of a panic caught at the boundary (a bug of ours, never the input's).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let msg = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("internal error (please report it): {msg}")
}

/// "keep pattern `x` matches no tensor name", for one or several patterns.
pub fn unmatched_message(patterns: &[String]) -> String {
    let list = crate::text::name_list(patterns.iter().map(String::as_str), usize::MAX);
    if patterns.len() == 1 {
        format!("{{keep}} pattern {list} matches no tensor name (a typo?)")
    } else {
        format!("{{keep}} patterns {list} match no tensor name (typos?)")
    }
}

/// The one warning of an FP8 output no model config describes: its quantization_config is
/// written to `path` (a lone file's, a folder run's).
pub fn side_config_notice(path: &Path) -> Warning {
    let text = format!(
        "no model config describes this FP8 output: its quantization_config is written to {}; \
         vLLM and transformers read it from the model's config.json only: merge it into that \
         file (the guide shows how)",
        esc_path(path)
    );
    Warning::new(WarningKind::NoModelConfig, text)
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&plain(&self.template()))
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Something the caller should hear about that does not stop the work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    pub kind: WarningKind,
    /// One line, a template (see `text`).
    pub text: String,
}

impl Warning {
    pub fn new(kind: WarningKind, text: String) -> Warning {
        Warning { kind, text }
    }
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&plain(&self.text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_paths_and_neutral_text() {
        let e = Error::DestinationExists {
            path: "o.safetensors".into(),
        };
        assert_eq!(e.kind(), ErrorKind::DestinationExists);
        assert_eq!(e.errno(), Some(libc::EEXIST));
        assert_eq!(
            e.template(),
            "o.safetensors: destination exists ({force} replaces it)"
        );
        assert_eq!(
            e.to_string(),
            "o.safetensors: destination exists (force replaces it)"
        );
        let full = Error::io(
            Path::new("d"),
            "write failed",
            io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert_eq!(full.kind(), ErrorKind::NoSpace);
        let e = Error::BadOption {
            option: OptionName::Threads,
            value: "99999".into(),
            expected: "a whole number from 0 to 1024".into(),
        };
        assert_eq!(e.kind(), ErrorKind::Usage);
        assert_eq!(
            e.template(),
            "{threads}: 99999 is not a whole number from 0 to 1024"
        );
        // A path with braces stays literal.
        let e = Error::DestinationIsFolder {
            path: "{force}".into(),
        };
        assert_eq!(e.to_string(), "{force}: destination is a folder");
    }

    #[test]
    fn no_message_spells_a_flag_or_keyword() {
        let p = PathBuf::from("x");
        let all = [
            Error::UnmatchedPatterns {
                path: p.clone(),
                patterns: vec!["a".into()],
            },
            Error::Overflow {
                path: p.clone(),
                target: Target::F16,
                values: 3,
                tensors: 1,
                worst: "w".into(),
                worst_values: 3,
                dequantized: 0,
            },
            Error::BadPattern {
                option: OptionName::Keep,
                pattern: "a[".into(),
                reason: "unclosed".into(),
            },
            Error::DestinationExists { path: p },
        ];
        for e in all {
            let t = e.template();
            assert!(!t.contains("--") && !t.contains("=True"), "{t}");
        }
    }
}
