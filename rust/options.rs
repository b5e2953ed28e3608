//! Every option of `convert`, `inspect`, `verify` and `finalize`, defined once (as ripgrep's
//! `crates/core/flags/defs.rs` defines its flags): its name, the kind of its value (which
//! decides its check, `Given::check`), its default, its help, and the commands that
//! take it, in the order their help lists them. The Python package makes of this one table
//! (`_core.OPTIONS`) its command-line parser, its API's keywords (checked against its
//! `TypedDict`s by a test), shell completion and the way messages spell an option.
//!
//! Below `given` and `record` (whose values it checks, `Given`); it asks only `vocab` (the
//! names of choices), `window` (the thread limit) and `naming` (sizes and stems).

use crate::vocab::{OnOverflow, OptionName, Target};

/// What an option's value is: it decides how the value is checked, spelled and completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A switch: given or not.
    Flag,
    /// A whole number from 0 to the option's `max`.
    Int,
    /// Bytes: a whole number, or a number with a unit (`naming::parse_size`).
    Size,
    /// A string.
    Text,
    /// Strings: the option repeats (`--keep a --keep b`, `keep=["a", "b"]`).
    Texts,
    /// A path.
    Path,
    /// One of the option's `choices`.
    Choice,
    /// A target dtype, or one of its aliases (`Target::parse`).
    Target,
    /// `I/N`: the I-th of N parts.
    Part,
    /// The stem of re-sharded outputs (`naming::is_stem`).
    Stem,
    /// Knobs of speed and memory (`convert::Knobs`): the API's only.
    Tuning,
}

/// An option's default value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Default {
    /// Not given (None).
    Absent,
    /// A switch's: off.
    Off,
    /// A repeated option's: none.
    Empty,
    Int(u64),
    Str(&'static str),
}

impl serde::Serialize for Default {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            Default::Absent => s.serialize_none(),
            Default::Off => s.serialize_bool(false),
            Default::Empty => serde::ser::SerializeTuple::end(s.serialize_tuple(0)?),
            Default::Int(n) => s.serialize_u64(n),
            Default::Str(t) => s.serialize_str(t),
        }
    }
}

/// One option: what every command that takes it shares.
#[derive(Clone, Copy, Debug)]
pub struct Def {
    /// The API's keyword (`--` and the name with `-` for `_` on the command line).
    pub name: &'static str,
    pub kind: Kind,
    pub default: Default,
    /// `Choice`: the values; `Target`: the targets (the aliases are `Target::ALIASES`).
    pub choices: &'static [&'static str],
    /// `Int`: the largest value.
    pub max: u64,
    /// The command line's name of the value in help (`FILE`); none for a switch or a choice.
    pub metavar: Option<&'static str>,
    /// A one-letter command-line form (`-q`).
    pub short: Option<&'static str>,
    /// The command line's help, as `--help` shows it (`{max}`: the option's `max`).
    pub help: &'static str,
    /// `Text`, `Texts`: what a value must be, for the message of one that is not.
    pub expected: &'static str,
    /// `Texts`: an empty string is refused.
    pub nonempty: bool,
    /// What it is to a run, beside its value (`Role`).
    pub role: Role,
}

/// What an option is to a run, beside its value: which options the front ends hand on, and
/// a manifest records, together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// None of those below.
    Other,
    /// Beside `to`, it decides what the output holds: what each tensor becomes, or which
    /// files a folder's output copies (a folder's manifest records it).
    Precision,
    /// How a source is read: which dict of a checkpoint, which prefixes its names lose.
    Source,
    /// How the command line shows a run (JSON, progress, quiet): the terminal's, never the
    /// engine's.
    Terminal,
}

const fn def(name: &'static str, kind: Kind, help: &'static str) -> Def {
    let default = match kind {
        Kind::Flag => Default::Off,
        Kind::Texts => Default::Empty,
        _ => Default::Absent,
    };
    Def {
        name,
        kind,
        default,
        choices: &[],
        max: 0,
        metavar: None,
        short: None,
        help,
        expected: "",
        nonempty: false,
        role: Role::Other,
    }
}

impl Def {
    const fn metavar(self, metavar: &'static str) -> Def {
        Def {
            metavar: Some(metavar),
            ..self
        }
    }

    const fn default(self, default: Default) -> Def {
        Def { default, ..self }
    }

    const fn expected(self, expected: &'static str) -> Def {
        Def { expected, ..self }
    }

    const fn precision(self) -> Def {
        Def {
            role: Role::Precision,
            ..self
        }
    }

    const fn source(self) -> Def {
        Def {
            role: Role::Source,
            ..self
        }
    }

    const fn terminal(self) -> Def {
        Def {
            role: Role::Terminal,
            ..self
        }
    }
}

/// Where a command takes an option: its command line, its API function, or both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Front {
    Both,
    Cli,
    Api,
}

/// An option as one command takes it: where, and what differs there from its `Def`.
#[derive(Clone, Copy, Debug)]
pub struct Use {
    pub name: &'static str,
    pub front: Front,
    /// This command's own help; `Some("")`: hidden from its help.
    pub help: Option<&'static str>,
    /// This command's own default.
    pub default: Option<Default>,
}

const fn both(name: &'static str) -> Use {
    Use {
        name,
        front: Front::Both,
        help: None,
        default: None,
    }
}

const fn cli(name: &'static str) -> Use {
    Use {
        front: Front::Cli,
        ..both(name)
    }
}

const fn api(name: &'static str) -> Use {
    Use {
        front: Front::Api,
        ..both(name)
    }
}

impl Use {
    const fn help(self, help: &'static str) -> Use {
        Use {
            help: Some(help),
            ..self
        }
    }
}

const TARGET_HELP: &str = "target dtype: bf16 (bfloat16), fp16 (float16, half), keep (every dtype \
    kept: a PyTorch checkpoint changes format only), or fp8 / fp8-block (FP8 weights for vLLM, \
    one scale per channel / per 128x128 block; the rest bf16)";

/// Every option, once.
pub const DEFS: &[Def] = &[
    Def {
        choices: Target::NAMES,
        ..def("to", Kind::Target, "") // help: per command (its default)
            .metavar("DTYPE")
            .default(Default::Str("bf16"))
    },
    Def {
        max: crate::window::MAX_THREADS as u64,
        ..def(
            "threads",
            Kind::Int,
            "worker threads, at most {max} (default 0: all cores)",
        )
        .metavar("N")
    },
    def("force", Kind::Flag, ""), // help: per command
    def(
        "resume",
        Kind::Flag,
        "folders: continue an interrupted run, skipping the files already done",
    ),
    def(
        "shard",
        Kind::Part,
        "folders: convert only the I-th of N subsets of the weight files (N at most the \
         number of files; then `stcast finalize`)",
    )
    .metavar("I/N"),
    def(
        "allow_quantized",
        Kind::Flag,
        "convert a quantized checkpoint anyway (its F32 scales become bf16 too)",
    ),
    def(
        "follow_links",
        Kind::Flag,
        "folders (checkpoint folders too): follow symlinks that lead outside SRC (by default \
         only links within it and into a Hugging Face cache's blobs/ are followed)",
    ),
    def(
        "max_shard_size",
        Kind::Size,
        "re-shard: write shards of at most SIZE bytes each, header included, and an index \
         (SIZE: 5GB, 4.5GiB, 500MB...; KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of \
         1024, any case); SRC a file or folder, DST a folder",
    )
    .metavar("SIZE"),
    def(
        "name",
        Kind::Stem,
        "with {max_shard_size}: name the output STEM-00001-of-0000N.safetensors and \
         STEM.safetensors.index.json (STEM.safetensors for one shard) instead of after the \
         input's stem; --name model gives the names transformers' from_pretrained loads. \
         For one checkpoint: a file, or a folder of one index's shards",
    )
    .metavar("STEM"),
    def(
        "keep",
        Kind::Texts,
        "keep float tensors whose name matches GLOB (fnmatch: * ? [seq]) in their dtype; \
         repeatable, e.g. --keep '*norm*'",
    )
    .metavar("GLOB")
    .expected("a string (an fnmatch pattern)")
    .precision(),
    Def {
        max: u64::MAX,
        ..def(
            "keep_min_size",
            Kind::Int,
            "keep float tensors with fewer than N elements in their dtype (default 0: none)",
        )
        .metavar("N")
        .default(Default::Int(0))
        .precision()
    },
    def(
        "from_bf16",
        Kind::Flag,
        "with {to=fp16}, convert BF16 tensors too (else they are copied as BF16)",
    )
    .precision(),
    Def {
        choices: OnOverflow::NAMES,
        ..def(
            "on_overflow",
            Kind::Choice,
            "finite values that would become inf (|x| >= 65520 in fp16): warn (default), \
             error (exit 1, nothing written), or keep those tensors in their dtype (reads the \
             float tensors once more first)",
        )
        .default(Default::Str("warn"))
        .precision()
    },
    def(
        "strict",
        Kind::Flag,
        "make a {keep} pattern that matches no tensor an error (nothing is written)",
    ),
    def(
        "key",
        Kind::Text,
        "PyTorch checkpoints: convert the dict of tensors at KEY of SRC (dotted for deeper \
         levels, e.g. ema or state.model); needed when it holds several",
    )
    .metavar("KEY")
    .expected("a string (a dotted key of the checkpoint)")
    .source(),
    def(
        "include",
        Kind::Texts,
        "folders: copy the files and folders left out as training state (optimizer, scheduler, \
         RNG states, DeepSpeed's global_stepN/, ...) whose path in SRC matches GLOB (fnmatch; \
         a folder whole); repeatable",
    )
    .metavar("GLOB")
    .expected("a string (an fnmatch pattern)")
    .precision(),
    def(
        "exclude",
        Kind::Texts,
        "folders: leave out the files that would be copied or rewritten (not weights, not \
         indexes) whose path in SRC, or a folder above it, matches GLOB (fnmatch); \
         repeatable, and it wins over --include",
    )
    .metavar("GLOB")
    .expected("a string (an fnmatch pattern)")
    .precision(),
    Def {
        nonempty: true,
        ..def(
            "strip_prefix",
            Kind::Texts,
            "drop PREFIX from tensor names (repeatable: each in turn, from what the one before \
         left), e.g. --strip-prefix module. --strip-prefix _orig_mod.",
        )
        .metavar("PREFIX")
        .expected("a non-empty string (a name prefix)")
        .source()
    },
    def(
        "no_record",
        Kind::Flag,
        "record nothing in the output's __metadata__ (by default convert records its options \
         there, under \"stcast\", and `stcast verify SRC DST` uses them): it is the input's, \
         and verify needs convert's options",
    )
    .precision(),
    def(
        "config",
        Kind::Path,
        "a lone checkpoint (a file, a DCP or ZeRO folder): the model's config.json, written \
         beside the output as config.json with its dtype set (and, under an FP8 target, the \
         quantization_config that describes the output; its hidden_size and \
         (moe_)intermediate_size prove how fused MoE experts lie, which are then split per \
         expert and quantized)",
    )
    .metavar("FILE"),
    def("report", Kind::Path, "").metavar("FILE"), // help: per command
    def(
        "dry_run",
        Kind::Flag,
        "change nothing: run every check and show the plan (the same as `stcast inspect SRC \
         DST` with these options)",
    ),
    def(
        "scan",
        Kind::Flag,
        "read the data: per tensor, how many values would overflow or underflow",
    ),
    def(
        "loose",
        Kind::Flag,
        "for files from other tools: any float tensor may be kept, and tensor order, header \
         layout and NaN encodings are ignored",
    ),
    def("json", Kind::Flag, "print the report as JSON on stdout").terminal(),
    def(
        "progress",
        Kind::Flag,
        "show progress when stderr is not a terminal too (logs, SLURM): a line per 5% or 10 s \
         with bytes, rate and ETA",
    )
    .terminal(),
    Def {
        short: Some("q"),
        ..def("quiet", Kind::Flag, "no progress, no summary, no warnings").terminal()
    },
    def("tuning", Kind::Tuning, ""),
];

const TO: Use = both("to").help("{target} (default bf16)");

const CONVERT: &[Use] = &[
    TO,
    both("threads"),
    both("force").help("replace DST (and a {report} file)"),
    both("resume"),
    both("shard"),
    both("allow_quantized"),
    both("follow_links"),
    both("max_shard_size"),
    both("name"),
    both("keep"),
    both("keep_min_size"),
    both("from_bf16"),
    both("on_overflow"),
    both("strict"),
    both("key"),
    both("strip_prefix"),
    both("include"),
    both("exclude"),
    both("no_record"),
    both("config"),
    both("report").help(
        "write the numeric report (per tensor: overflow, underflow, errors) to FILE as JSON, \
         published with the output",
    ),
    cli("dry_run"),
    cli("scan").help(""), // hidden: for --dry-run
    cli("json"),
    cli("progress"),
    cli("quiet"),
    api("tuning"),
];

const INSPECT: &[Use] = &[
    TO,
    both("keep"),
    both("keep_min_size"),
    both("from_bf16"),
    both("on_overflow"),
    both("strict"),
    both("key"),
    both("strip_prefix"),
    both("include"),
    both("exclude"),
    both("scan"),
    both("threads").help("{help} (with {scan})"),
    both("force").help("as for convert: DST may exist"),
    both("resume"),
    both("shard"),
    both("allow_quantized"),
    both("follow_links"),
    both("max_shard_size"),
    both("name"),
    both("no_record"),
    both("config").help(
        "as for convert: check where it goes; under an FP8 target its sizes split fused MoE \
         experts as convert does",
    ),
    both("report").help("as for convert: check this report path"),
    cli("json"),
    cli("progress"),
    api("tuning"),
];

const VERIFY: &[Use] = &[
    both("loose"),
    Use {
        default: Some(Default::Absent),
        ..both("to").help("{target} (default: the one DST was converted to)")
    },
    both("keep").help(
        "as convert's {keep} GLOB (repeatable; default: the patterns DST's record of convert's \
         options holds)",
    ),
    Use {
        default: Some(Default::Absent),
        ..both("keep_min_size")
            .help("as convert's {keep_min_size} N (default: DST's record's, else 0: none)")
    },
    both("from_bf16").help("as convert's {from_bf16} (default: DST's record's)"),
    Use {
        default: Some(Default::Absent),
        ..both("on_overflow").help(
            "as convert's {on_overflow}: warn, error or keep (default: DST's record's, else warn)",
        )
    },
    both("key").help("as convert's {key} KEY (default: DST's record's)"),
    both("strip_prefix").help("as convert's {strip_prefix} PREFIX (default: DST's record's)"),
    both("include").help("as convert's {include} GLOB (default: DST's record's)"),
    both("exclude").help("as convert's {exclude} GLOB (default: DST's record's)"),
    both("name").help(
        "the STEM DST's re-sharded files were written under (convert {name} STEM): they are \
         SRC's re-sharding",
    ),
    both("threads"),
    both("report").help("once verified, write the numeric report `convert {report}` gives to FILE"),
    both("force").help("replace an existing report FILE"),
    cli("json"),
    cli("progress"),
    cli("quiet"),
    api("tuning"),
];

/// Each command's options, in the order of its help.
pub const COMMANDS: &[(&str, &[Use])] = &[
    ("convert", CONVERT),
    ("inspect", INSPECT),
    ("verify", VERIFY),
    ("finalize", &[cli("json"), cli("progress"), cli("quiet")]),
];

/// The definition of option `name`.
pub fn find(name: &str) -> Option<&'static Def> {
    DEFS.iter().find(|d| d.name == name)
}

/// One option of one command, as the front ends read it (`_core.OPTIONS` is the list of
/// them, command by command, each command's in the order of its help).
#[derive(Debug, serde::Serialize)]
pub struct Row {
    pub command: &'static str,
    pub name: &'static str,
    pub kind: Kind,
    pub front: Front,
    pub default: Default,
    pub choices: Vec<&'static str>,
    pub max: Option<u64>,
    pub metavar: Option<&'static str>,
    pub short: Option<&'static str>,
    /// None: hidden (or the API's only).
    pub help: Option<String>,
    pub role: Role,
}

/// Every option of every command, as rows (`Row`).
pub fn rows() -> Vec<Row> {
    let mut rows = Vec::new();
    for (command, uses) in COMMANDS {
        for u in *uses {
            let d = find(u.name).expect("every option a command takes is defined");
            let max = (d.kind == Kind::Int).then_some(d.max);
            let help = u
                .help
                .unwrap_or(d.help)
                .replace("{help}", d.help)
                .replace("{target}", TARGET_HELP)
                .replace("{max}", &d.max.to_string());
            let mut choices = d.choices.to_vec();
            if d.kind == Kind::Target {
                for (alias, _) in Target::ALIASES {
                    if !choices.contains(alias) {
                        choices.push(alias);
                    }
                }
            }
            rows.push(Row {
                command,
                name: d.name,
                kind: d.kind,
                front: u.front,
                default: u.default.unwrap_or(d.default),
                choices,
                max,
                metavar: d.metavar,
                short: d.short,
                help: (!help.is_empty() && u.front != Front::Api).then_some(help),
                role: d.role,
            });
        }
    }
    rows
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
            Some(s) => crate::naming::parse_size(s),
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

    /// This value checked as option `def` takes it (a repeated option: one of its values),
    /// as the engine stands for it (a target's canonical name, a size in bytes). None: an
    /// option the engine does not check (a switch, `I/N`, a path, tuning): the caller keeps
    /// the value.
    pub fn check(&self, def: &Def) -> crate::Result<Option<Checked>> {
        let Some(option) = OptionName::from_name(def.name) else {
            return Ok(None);
        };
        let text = |t: &str| Checked::Text(t.to_string());
        Ok(Some(match def.kind {
            Kind::Int => Checked::Whole(self.whole(option, def.max)?),
            Kind::Size => Checked::Whole(self.size()?),
            Kind::Target => text(self.target()?.name()),
            Kind::Choice => text(self.choice(option, def.choices, |s| {
                def.choices.iter().find(|c| **c == s).copied()
            })?),
            Kind::Stem => Checked::Text(self.stem()?),
            Kind::Text | Kind::Texts => match &self.text {
                Some(s) if !(def.nonempty && s.is_empty()) => text(s),
                _ => return Err(self.bad(option, def.expected)),
            },
            Kind::Flag | Kind::Path | Kind::Part | Kind::Tuning => return Ok(None),
        }))
    }

    /// `name`: the stem of a re-sharded group's outputs.
    pub fn stem(&self) -> crate::Result<String> {
        match &self.text {
            Some(s) if crate::naming::is_stem(s) => Ok(s.clone()),
            _ => Err(self.bad(OptionName::Name, crate::naming::STEM_EXPECTED)),
        }
    }
}

/// An option's value as `Given::check` found it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(untagged)]
pub enum Checked {
    Whole(u64),
    Text(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::OptionName;

    #[test]
    fn every_option_a_message_names_is_defined_and_taken_by_the_api() {
        for name in OptionName::NAMES {
            let d = find(name).unwrap_or_else(|| panic!("{name} has no definition"));
            let api = rows()
                .into_iter()
                .any(|r| r.name == d.name && r.front != Front::Cli);
            assert!(api, "{name}: no API function takes it");
        }
    }

    #[test]
    fn every_definition_is_used_once_per_command_and_named_once() {
        let mut names: Vec<_> = DEFS.iter().map(|d| d.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), DEFS.len(), "an option defined twice");
        for d in DEFS {
            assert!(COMMANDS
                .iter()
                .any(|(_, uses)| uses.iter().any(|u| u.name == d.name)));
        }
        for (command, uses) in COMMANDS {
            let mut seen: Vec<_> = uses.iter().map(|u| u.name).collect();
            seen.sort();
            seen.dedup();
            assert_eq!(seen.len(), uses.len(), "{command} takes an option twice");
        }
    }

    #[test]
    fn rows_carry_each_commands_help_default_and_limits() {
        let rows = rows();
        let row = |c: &str, n: &str| rows.iter().find(|r| r.command == c && r.name == n).unwrap();
        assert_eq!(row("convert", "to").default, Default::Str("bf16"));
        assert_eq!(row("verify", "to").default, Default::Absent);
        assert!(row("verify", "to")
            .help
            .as_deref()
            .unwrap()
            .ends_with("converted to)"));
        assert!(row("convert", "to").choices.contains(&"half"));
        let threads = row("inspect", "threads");
        assert_eq!(threads.max, Some(crate::window::MAX_THREADS as u64));
        let max = crate::window::MAX_THREADS.to_string();
        assert!(threads.help.as_deref().unwrap().contains(&max));
        assert_eq!(row("convert", "scan").help, None); // hidden: --dry-run's
        assert_eq!(row("convert", "tuning").help, None); // the API's only
        assert_eq!(row("inspect", "scan").front, Front::Both);
        assert!(!rows
            .iter()
            .any(|r| r.command == "inspect" && r.name == "quiet"));
        assert_eq!(row("convert", "keep_min_size").max, Some(u64::MAX));
        let json = serde_json::to_value(row("convert", "keep")).unwrap();
        assert_eq!(json["default"], serde_json::json!([]));
        assert_eq!(json["kind"], "texts");
        assert_eq!(json["role"], "precision");
        let sources: Vec<_> = DEFS.iter().filter(|d| d.role == Role::Source).collect();
        assert_eq!(
            sources.iter().map(|d| d.name).collect::<Vec<_>>(),
            ["key", "strip_prefix"]
        );
        let shown: Vec<_> = DEFS.iter().filter(|d| d.role == Role::Terminal).collect();
        assert_eq!(
            shown.iter().map(|d| d.name).collect::<Vec<_>>(),
            ["json", "progress", "quiet"]
        );
    }
}
