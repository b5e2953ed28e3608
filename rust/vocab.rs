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

impl Taken {
    /// Why a side output at that path is refused.
    pub fn what(self) -> &'static str {
        match self {
            Taken::Input => "path is the input",
            Taken::Output => "path is the output",
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
            Target::Bf16 => Some(Dtype::BF16),
            Target::F16 => Some(Dtype::F16),
            Target::Keep => None,
        }
    }

    /// The name torch and `config.json` (`torch_dtype`) give the target dtype; `None` for
    /// `Keep` (a config's dtype stays as it is).
    pub fn torch_name(self) -> Option<&'static str> {
        match self {
            Target::Bf16 => Some("bfloat16"),
            Target::F16 => Some("float16"),
            Target::Keep => None,
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
        /// Re-sharding: the stem of the output shards and index (`shard::check_stem`).
        Name = "name",
    }
}

/// Every dtype name of the safetensors format, in the crate's order.
pub const DTYPES: &[Dtype] = &[
    Dtype::BOOL,
    Dtype::F4,
    Dtype::F6_E2M3,
    Dtype::F6_E3M2,
    Dtype::U8,
    Dtype::I8,
    Dtype::F8_E5M2,
    Dtype::F8_E4M3,
    Dtype::F8_E8M0,
    Dtype::F8_E4M3FNUZ,
    Dtype::F8_E5M2FNUZ,
    Dtype::I16,
    Dtype::U16,
    Dtype::F16,
    Dtype::BF16,
    Dtype::I32,
    Dtype::U32,
    Dtype::F32,
    Dtype::C64,
    Dtype::F64,
    Dtype::I64,
    Dtype::U64,
];

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
        assert_eq!(DTYPES.len(), 22);
    }
}

/// A list of names, serialized as a tuple (the constants of `_core` are tuples).
pub struct Names(pub Vec<String>);

impl Names {
    fn of<T: ToString>(items: impl IntoIterator<Item = T>) -> Names {
        Names(items.into_iter().map(|x| x.to_string()).collect())
    }
}

impl serde::Serialize for Names {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let mut t = s.serialize_tuple(self.0.len())?;
        for n in &self.0 {
            t.serialize_element(n)?;
        }
        t.end()
    }
}

/// Every name and limit the Python package reads from the engine, as `_core`'s constants
/// (`TARGETS`, `TARGET_ALIASES`, ...): the adapter adds each field as a module attribute.
#[derive(serde::Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub struct Exports {
    pub targets: Names,
    #[serde(serialize_with = "pairs")]
    pub target_aliases: Vec<(&'static str, &'static str)>,
    #[serde(serialize_with = "pairs")]
    pub target_torch_names: Vec<(&'static str, &'static str)>,
    #[serde(serialize_with = "pairs")]
    pub target_dtypes: Vec<(&'static str, String)>,
    pub reasons: Names,
    pub kept_reasons: Names,
    pub error_kinds: Names,
    pub warning_kinds: Names,
    pub options: Names,
    pub input_formats: Names,
    pub on_overflow: Names,
    pub unmatched: Names,
    pub read_advice: Names,
    pub dtypes: Names,
    pub quantized_dtypes: Names,
    pub isas: Names,
    pub max_threads: usize,
    pub default_window_mib: usize,
}

/// Serialize key-value pairs as a map, in their order.
fn pairs<K: serde::Serialize, V: serde::Serialize, S: serde::Serializer>(
    pairs: &[(K, V)],
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_map(pairs.iter().map(|(k, v)| (k, v)))
}

impl Default for Exports {
    fn default() -> Exports {
        let targets = Target::ALL.iter();
        Exports {
            targets: Names::of(Target::NAMES),
            target_aliases: Target::ALIASES
                .iter()
                .map(|(a, t)| (*a, t.name()))
                .collect(),
            target_torch_names: targets
                .clone()
                .filter_map(|t| Some((t.name(), t.torch_name()?)))
                .collect(),
            target_dtypes: targets
                .filter_map(|t| Some((t.name(), t.dtype()?.to_string())))
                .collect(),
            reasons: Names::of(ReasonCode::NAMES),
            kept_reasons: Names::of(
                ReasonCode::ALL
                    .iter()
                    .filter(|r| r.is_kept())
                    .map(|r| r.name()),
            ),
            error_kinds: Names::of(ErrorKind::NAMES),
            warning_kinds: Names::of(WarningKind::NAMES),
            options: Names::of(OptionName::NAMES),
            input_formats: Names::of(InputFormat::NAMES),
            on_overflow: Names::of(OnOverflow::NAMES),
            unmatched: Names::of(Unmatched::NAMES),
            read_advice: Names::of(ReadAdvice::NAMES),
            dtypes: Names::of(DTYPES),
            quantized_dtypes: Names::of(DTYPES.iter().filter(|d| is_quantized_dtype(**d))),
            isas: Names::of(crate::kernels::Isa::available().iter().map(|i| i.name())),
            max_threads: crate::window::MAX_THREADS,
            default_window_mib: crate::window::DEFAULT_WINDOW >> 20,
        }
    }
}

/// An option's value as a caller gave it, for the checks every front end shares (ranges,
/// choices and aliases are checked here, once): its text when it is a string, its number
/// when it is a whole number (never a bool: `threads=True` is a mistake), and how the
/// caller writes it, for the message.
#[derive(Clone, Debug, Default)]
pub struct Given {
    pub text: Option<String>,
    pub whole: Option<u64>,
    pub repr: String,
}

impl Given {
    /// The usage error of `option` with this value.
    pub fn bad(&self, option: OptionName, expected: impl Into<String>) -> crate::Error {
        crate::Error::BadOption {
            option,
            value: self.repr.clone(),
            expected: expected.into(),
        }
    }

    /// A whole number in `0..=max`.
    pub fn whole(&self, option: OptionName, max: u64) -> crate::Result<u64> {
        match self.whole {
            Some(n) if n <= max => Ok(n),
            _ => Err(self.bad(option, format!("a whole number from 0 to {max}"))),
        }
    }

    /// One of `names`, as `parse` reads it.
    pub fn choice<T>(
        &self,
        option: OptionName,
        names: &[&str],
        parse: impl Fn(&str) -> Option<T>,
    ) -> crate::Result<T> {
        let found = self.text.as_deref().and_then(parse);
        found.ok_or_else(|| self.bad(option, format!("one of {}", names.join(", "))))
    }

    /// `to`: a target or one of its aliases.
    pub fn target(&self) -> crate::Result<Target> {
        self.choice(OptionName::To, Target::NAMES, Target::parse)
    }

    /// `on_overflow`.
    pub fn on_overflow(&self) -> crate::Result<OnOverflow> {
        self.choice(
            OptionName::OnOverflow,
            OnOverflow::NAMES,
            OnOverflow::from_name,
        )
    }

    /// `threads`: 0 (one per core) to `MAX_THREADS`.
    pub fn threads(&self) -> crate::Result<usize> {
        Ok(self.whole(OptionName::Threads, crate::window::MAX_THREADS as u64)? as usize)
    }

    /// `max_shard_size`: a whole number of bytes, or a string with a unit.
    pub fn size(&self) -> crate::Result<u64> {
        let parsed = match &self.text {
            Some(s) => crate::shard::parse_size(s),
            None => self.whole.filter(|&n| n > 0),
        };
        parsed.ok_or_else(|| {
            self.bad(
                OptionName::MaxShardSize,
                "a size in bytes: a number with an optional unit, B, KB, MB, GB, TB (powers of \
                 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 5GB",
            )
        })
    }

    /// `name`: the stem of a re-sharded group's outputs.
    pub fn stem(&self) -> crate::Result<String> {
        match &self.text {
            Some(s) if crate::shard::check_stem(s).is_ok() => Ok(s.clone()),
            _ => Err(self.bad(OptionName::Name, crate::shard::STEM_EXPECTED)),
        }
    }
}

#[cfg(test)]
mod given_tests {
    use super::*;

    fn text(s: &str) -> Given {
        Given {
            text: Some(s.into()),
            repr: format!("'{s}'"),
            ..Given::default()
        }
    }

    #[test]
    fn checks_ranges_choices_and_aliases() {
        assert_eq!(text("BFloat16").target().unwrap(), Target::Bf16);
        let e = text("bf17").target().unwrap_err().to_string();
        assert!(
            e.contains("'bf17'") && e.contains("one of bf16, fp16, keep"),
            "{e}"
        );
        let n = |n| Given {
            whole: Some(n),
            repr: n.to_string(),
            ..Given::default()
        };
        assert_eq!(n(4).threads().unwrap(), 4);
        assert!(n(1 << 20).threads().is_err());
        assert!(Given::default().threads().is_err()); // a bool, a float, None
        assert_eq!(text("3kB").size().unwrap(), 3000);
        assert!(n(0).size().is_err());
        assert!(text("a/b").stem().is_err());
    }
}
