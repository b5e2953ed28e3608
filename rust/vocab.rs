//! Every name that crosses the language boundary, defined once.
//!
//! Targets, plan reasons, error kinds, option names and the choices of the enumerated
//! options are plain enums here with a stable lower-case name each. `_core` exports these
//! name lists; the Python package, its stubs and the CLI derive from them (a test checks the
//! stubs' `Literal` lists against them), so that a name is spelled in one place.

use safetensors::tensor::Dtype;

/// A fieldless enum whose variants each have a stable name: `name()`, `from_name()`, `ALL`
/// and `NAMES` in the order declared.
macro_rules! named {
    ($(#[$meta:meta])* pub enum $ty:ident {
        $($(#[$vmeta:meta])* $variant:ident = $name:literal,)*
    }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $ty {
            $($(#[$vmeta])* $variant,)*
        }

        impl $ty {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant,)*];
            /// Every variant's name, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($name,)*];

            /// The stable name.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)*
                }
            }

            /// The variant with this exact name.
            pub fn from_name(s: &str) -> Option<$ty> {
                match s {
                    $($name => Some($ty::$variant),)*
                    _ => None,
                }
            }
        }

        /// Reports carry the stable name.
        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }
    };
}

named! {
    /// The input formats reports name (`InspectReport.format`).
    pub enum InputFormat {
        Safetensors = "safetensors",
        Pytorch = "pytorch",
        PytorchLegacy = "pytorch-legacy",
        Dcp = "dcp",
        DcpSafetensors = "dcp-safetensors",
        /// A DeepSpeed ZeRO checkpoint folder.
        DeepSpeed = "deepspeed",
    }
}

impl InputFormat {
    /// The name reports give a file of this format (what is not PyTorch was read as
    /// safetensors).
    pub fn of(f: crate::torch::Format) -> InputFormat {
        use crate::torch::Format;
        match f {
            Format::TorchZip => InputFormat::Pytorch,
            Format::TorchLegacy => InputFormat::PytorchLegacy,
            Format::Dcp => InputFormat::Dcp,
            Format::DcpSafetensors => InputFormat::DcpSafetensors,
            Format::DeepSpeed => InputFormat::DeepSpeed,
            _ => InputFormat::Safetensors,
        }
    }
}

named! {
    /// What a path a side output (`report=`) must not be is.
    pub enum Taken {
        Input = "input",
        Output = "output",
    }
}

named! {
    /// What a side output is, as its messages name it (`output::check_side_output`).
    pub enum Side {
        Report = "report",
        Output = "output",
        /// An FP8 output's `quantization_config`, beside a lone file (`convert::Options`).
        Config = "config",
    }
}

impl Taken {
    /// Why a side output at that path is refused.
    pub fn what(self) -> &'static str {
        match self {
            Taken::Input => "path is the input file",
            Taken::Output => "path is the output file",
        }
    }
}

named! {
    /// What floating-point tensors become.
    pub enum Target {
        Bf16 = "bf16",
        F16 = "fp16",
        /// Every tensor keeps its dtype: only the format changes (PyTorch to safetensors).
        Keep = "keep",
        /// FP8 E4M3 weights with one scale per output channel (compressed-tensors
        /// `FP8_DYNAMIC`); every other float tensor becomes BF16.
        Fp8 = "fp8",
        /// FP8 E4M3 weights with one scale per 128x128 block (compressed-tensors
        /// `FP8_BLOCK`); every other float tensor becomes BF16.
        Fp8Block = "fp8-block",
    }
}

named! {
    /// How an FP8 target groups a weight's values under one scale.
    pub enum Strategy {
        /// One scale per row (output channel).
        Channel = "channel",
        /// One scale per 128x128 tile, partial at the edges.
        Block = "block",
    }
}

named! {
    /// Why a float tensor is not quantized under an FP8 target (it becomes BF16 instead).
    pub enum Fp8Skip {
        /// Its name's last part is not `weight`.
        NotWeight = "not_weight",
        /// Not 2-D.
        NotMatrix = "not_2d",
        /// 3-D fused MoE experts left fused (`experts::left` says why).
        Experts = "experts",
        /// Its module's name ends in `norm` (any case: BERT's `LayerNorm` too).
        Norm = "norm",
        /// Embeddings (`embed_tokens`, `*embeddings*`, `wte`, `wpe`): vLLM loads them unquantized.
        Embedding = "embedding",
        /// The output head (`lm_head`): vLLM loads it unquantized.
        LmHead = "lm_head",
        /// A MoE router gate (`*.mlp.gate`, `*.router`): kept precise for routing.
        Router = "router",
        /// A vision-language model's vision tower or its projector into the language model
        /// (`quant::VISION_MODULES`): llm-compressor's recipes and vLLM's FP8 checkpoints
        /// leave them unquantized.
        Vision = "vision",
        /// F64 (compressed-tensors quantizes F32, F16 and BF16 weights).
        Dtype = "dtype",
        /// No elements.
        Empty = "empty",
        /// It holds NaN or infinity: a scale would be NaN or infinite, which vLLM cannot use.
        NonFinite = "nonfinite",
        /// The input already has a tensor named like its scale (`X.weight_scale`).
        ScaleNameTaken = "scale_name_taken",
        /// One of its groups (a row, or a band of 128 rows) is larger than a window holds.
        GroupTooLarge = "group_too_large",
    }
}

impl Fp8Skip {
    /// Why, in words, for inspect and messages.
    pub fn words(self) -> &'static str {
        match self {
            Fp8Skip::NotWeight => "not a weight",
            Fp8Skip::NotMatrix => "not 2-D",
            Fp8Skip::Experts => "3-D MoE experts, not split per expert",
            Fp8Skip::Norm => "a norm",
            Fp8Skip::Embedding => "an embedding",
            Fp8Skip::LmHead => "the output head",
            Fp8Skip::Router => "a MoE router gate",
            Fp8Skip::Vision => "the vision tower or its projector",
            Fp8Skip::Dtype => "F64",
            Fp8Skip::Empty => "empty",
            Fp8Skip::NonFinite => "holds NaN or inf",
            Fp8Skip::ScaleNameTaken => "its scale's name is taken by another tensor",
            Fp8Skip::GroupTooLarge => "a group (row or 128-row band) larger than 48 MiB",
        }
    }
}

impl Target {
    /// Other spellings users write (as torch, numpy and config.json do), lower case.
    pub const ALIASES: &'static [(&'static str, Target)] = &[
        ("bfloat16", Target::Bf16),
        ("fp16", Target::F16),
        ("f16", Target::F16),
        ("float16", Target::F16),
        ("half", Target::F16),
        ("fp8-dynamic", Target::Fp8),
        ("fp8_dynamic", Target::Fp8),
        ("fp8_block", Target::Fp8Block),
    ];

    /// The target a name or alias means, case-insensitively.
    pub fn parse(s: &str) -> Option<Target> {
        let s = s.to_ascii_lowercase();
        Target::from_name(&s).or_else(|| {
            Target::ALIASES
                .iter()
                .find(|(alias, _)| *alias == s)
                .map(|(_, t)| *t)
        })
    }

    /// The output dtype of a converted tensor; `None` for `Keep`, which converts none.
    pub fn dtype(self) -> Option<Dtype> {
        match self {
            Target::Bf16 | Target::Fp8 | Target::Fp8Block => Some(Dtype::BF16),
            Target::F16 => Some(Dtype::F16),
            Target::Keep => None,
        }
    }

    /// The name torch and `config.json` (`torch_dtype`) give the target dtype; `None` for
    /// `Keep` (a config's dtype stays as it is).
    pub fn torch_name(self) -> Option<&'static str> {
        match self {
            Target::Bf16 | Target::Fp8 | Target::Fp8Block => Some("bfloat16"),
            Target::F16 => Some("float16"),
            Target::Keep => None,
        }
    }

    /// How an FP8 target quantizes weights; `None` for the others.
    pub fn strategy(self) -> Option<Strategy> {
        match self {
            Target::Fp8 => Some(Strategy::Channel),
            Target::Fp8Block => Some(Strategy::Block),
            _ => None,
        }
    }

    /// What messages call the output's float dtype: `BF16`, `F16`, or "their own dtype".
    pub fn describe(self) -> String {
        match self.dtype() {
            Some(d) => d.to_string(),
            None => "their own dtype".to_string(),
        }
    }
}

named! {
    /// Why a tensor is converted, kept in its source dtype, or copied (see `plan::Reason`).
    pub enum ReasonCode {
        Converted = "converted",
        /// An FP8 target's weight, written as F8_E4M3 with its scale.
        Quantized = "quantized",
        /// An FP8 input's weight, multiplied by its scale into the target dtype.
        Dequantized = "dequantized",
        /// An FP8 input's scale or zero point (or activation scale): used to dequantize, not
        /// written.
        Dropped = "dropped",
        KeepPattern = "keep_pattern",
        KeepMinSize = "keep_min_size",
        KeepOverflow = "keep_overflow",
        AlreadyTarget = "already_target",
        Bf16Source = "bf16_source",
        NotConverted = "not_converted",
        NotFloat = "not_float",
    }
}

impl ReasonCode {
    /// Is this a float tensor that would be converted but keeps its source dtype?
    pub fn is_kept(self) -> bool {
        matches!(
            self,
            ReasonCode::KeepPattern | ReasonCode::KeepMinSize | ReasonCode::KeepOverflow
        )
    }
}

named! {
    /// What a tensor a dequantized checkpoint drops was for (`inspect`'s rows).
    pub enum Companion {
        /// A weight's scale (`weight_scale`, `weight_scale_inv`, gpt-oss `_scales`).
        Scale = "scale",
        /// An NVFP4 weight's `weight_global_scale`.
        GlobalScale = "global_scale",
        /// An asymmetric weight's `weight_zero_point`.
        ZeroPoint = "zero_point",
        /// A packed weight's `weight_shape`.
        Shape = "shape",
        /// An activation scale (`input_scale`): nothing once the weight is dequantized.
        InputScale = "input_scale",
    }
}

named! {
    /// What to do when finite values would become infinite.
    pub enum OnOverflow {
        /// Convert, count, and say which tensors overflowed.
        Warn = "warn",
        /// Fail before publishing: nothing is left behind.
        Error = "error",
        /// Scan first and keep the tensors that would overflow in their source dtype.
        Keep = "keep",
    }
}

named! {
    /// What a `keep` pattern that matches no tensor name does: probably a typo.
    pub enum Unmatched {
        /// A plan warning.
        Warn = "warn",
        /// A refusal (the `strict` option).
        Error = "error",
        /// Nothing: the caller judges the patterns over several files (a folder).
        Ignore = "ignore",
    }
}

named! {
    /// Read-ahead advice for the input mapping (a tuning knob).
    pub enum ReadAdvice {
        /// None: the kernel's default read-ahead.
        Normal = "normal",
        /// `MADV_SEQUENTIAL` over the whole mapping (the default).
        Sequential = "sequential",
        /// `MADV_SEQUENTIAL`, and `MADV_WILLNEED` on the next window before converting one.
        WillNeed = "willneed",
    }
}

named! {
    /// The categories of failure. Each is one exception class in Python and one `kind` in
    /// the CLI's JSON; `error::Error` has one variant per failure, each in one category.
    pub enum ErrorKind {
        /// The input is not a valid checkpoint (or not one we read).
        InvalidInput = "invalid_input",
        /// The input changed while it was being read.
        InputChanged = "input_changed",
        /// We refuse what was asked: it would lose data or change the model unasked.
        Refused = "refused",
        /// The destination exists (a `FileExistsError` in Python).
        DestinationExists = "destination_exists",
        /// The destination's file system is full (an `OSError(ENOSPC)` in Python).
        NoSpace = "no_space",
        /// An option's value is out of range or malformed (exit status 2 in the CLI).
        Usage = "usage",
        /// An operating-system call failed (the matching `OSError` in Python).
        Io = "io",
        /// The caller asked us to stop.
        Cancelled = "cancelled",
    }
}

named! {
    /// What a warning is about (`error::Warning`): the `kind` of a Python `StcastWarning`.
    pub enum WarningKind {
        /// A `keep` pattern matches no tensor name.
        UnmatchedPattern = "unmatched_pattern",
        /// BF16 tensors are copied into an fp16 output.
        Bf16Copied = "bf16_copied",
        /// F32 tensors beside F8/F6/F4 ones are converted (their scales would change).
        Quantized = "quantized",
        /// No tensor changes dtype.
        NothingToConvert = "nothing_to_convert",
        /// Finite values became ±inf.
        Overflow = "overflow",
        /// Non-zero values became zero.
        Underflow = "underflow",
        /// A temp file left by a killed run was removed.
        StaleTemp = "stale_temp",
        /// Entries of a PyTorch checkpoint's state dict that are not tensors, left out.
        SkippedEntries = "skipped_entries",
        /// A PyTorch checkpoint's pickle names globals outside the allow-list (not called).
        UnlistedGlobals = "unlisted_globals",
        /// Files of a folder left out: trainer state, or PyTorch weights beside safetensors.
        SkippedFiles = "skipped_files",
        /// Re-sharding added `"format": "pt"` to the `__metadata__` of indexed shards.
        FormatAdded = "format_added",
        /// The files of one re-sharded group carry different `__metadata__`.
        MetadataDiffers = "metadata_differs",
        /// Re-sharding: DST holds shards of another cut that no manifest proves stcast's.
        UnindexedShards = "unindexed_shards",
        /// An FP8 target leaves weights unquantized (NaN or inf in them, 3-D experts).
        NotQuantized = "not_quantized",
        /// An FP8 block target: fused layers whose parts vLLM needs in multiples of 128.
        BlockShape = "block_shape",
        /// An FP8 output no model config describes: its `quantization_config` is beside it.
        NoModelConfig = "no_model_config",
        /// A prefix to strip from tensor names that no name starts with.
        UnmatchedPrefix = "unmatched_prefix",
        /// Fused MoE experts stored transposed were split per expert (a note).
        TransposedExperts = "transposed_experts",
    }
}

named! {
    /// The options of `convert`, `inspect` and `verify` that messages may refer to. A hint
    /// names them as `{force}` or `{on_overflow=keep}`; the CLI renders that as `--force` or
    /// `--on-overflow keep`, the Python API as `force=True` or `on_overflow="keep"`.
    pub enum OptionName {
        To = "to",
        Threads = "threads",
        Force = "force",
        Resume = "resume",
        Shard = "shard",
        Keep = "keep",
        KeepMinSize = "keep_min_size",
        Strict = "strict",
        FromBf16 = "from_bf16",
        OnOverflow = "on_overflow",
        AllowQuantized = "allow_quantized",
        Loose = "loose",
        Report = "report",
        FollowLinks = "follow_links",
        /// PyTorch checkpoints: the dotted key of the state dict to convert.
        Key = "key",
        /// PyTorch checkpoints: a prefix dropped from tensor names (repeatable).
        StripPrefix = "strip_prefix",
        MaxShardSize = "max_shard_size",
        /// Re-sharding: the stem of the output shards and index (`naming::is_stem`).
        Name = "name",
        /// A lone checkpoint's model config, written beside its output.
        Config = "config",
        /// Folders: globs of left-out files to copy anyway.
        Include = "include",
        /// Folders: globs of companion files to leave out.
        Exclude = "exclude",
        /// inspect: read every tensor for its numerics.
        Scan = "scan",
    }
}

/// Is this dtype one of the low-precision float formats of quantized checkpoints?
///
/// I8 and U8 are not: ordinary models carry U8 buffers, so they mean quantization only
/// beside a `quantization_config`, which the folder code judges.
pub fn is_quantized_dtype(d: Dtype) -> bool {
    matches!(
        d,
        Dtype::F8_E4M3
            | Dtype::F8_E5M2
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ
            | Dtype::F4
            | Dtype::F6_E2M3
            | Dtype::F6_E3M2
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        fn check<T: Copy + PartialEq + std::fmt::Debug>(
            all: &[T],
            names: &[&str],
            name: impl Fn(T) -> &'static str,
            from: impl Fn(&str) -> Option<T>,
        ) {
            assert_eq!(all.len(), names.len());
            for (v, n) in all.iter().zip(names) {
                assert_eq!(name(*v), *n);
                assert_eq!(from(n), Some(*v));
            }
            let mut sorted = names.to_vec();
            sorted.sort();
            sorted.dedup();
            assert_eq!(sorted.len(), names.len(), "duplicate names: {names:?}");
        }
        check(Target::ALL, Target::NAMES, Target::name, Target::from_name);
        check(
            ReasonCode::ALL,
            ReasonCode::NAMES,
            ReasonCode::name,
            ReasonCode::from_name,
        );
        check(
            ErrorKind::ALL,
            ErrorKind::NAMES,
            ErrorKind::name,
            ErrorKind::from_name,
        );
        check(
            WarningKind::ALL,
            WarningKind::NAMES,
            WarningKind::name,
            WarningKind::from_name,
        );
        check(
            OptionName::ALL,
            OptionName::NAMES,
            OptionName::name,
            OptionName::from_name,
        );
    }

    #[test]
    fn target_aliases() {
        for (s, t) in [
            ("bf16", Target::Bf16),
            ("BFloat16", Target::Bf16),
            ("fp16", Target::F16),
            ("half", Target::F16),
            ("float16", Target::F16),
        ] {
            assert_eq!(Target::parse(s), Some(t), "{s}");
        }
        assert_eq!(Target::parse("f32"), None);
    }
}
