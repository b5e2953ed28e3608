//! What the front ends give and get at the boundary: option values checked once, here,
//! whatever their source (`Given`), and the names and values the package exports
//! (`Exports`). Above `vocab`, `window`, `kernels` and `naming`, so that those stay leaves.

use std::path::{Path, PathBuf};

use crate::convert::{Options, Tuning};
use crate::input::InputOptions;
pub use crate::options::Given;
use crate::plan::PlanOptions;
use crate::record::Record;
use crate::verify::VerifyOptions;
use crate::vocab::{
    ErrorKind, InputFormat, OnOverflow, OptionName, ReadAdvice, ReasonCode, Target, Unmatched,
    WarningKind,
};

/// Refuses an option that does not apply to a `convert` or `inspect` run from `src` with the
/// options `given` (the names of those set, not at their default): a usage error naming it
/// and what the run is instead (`Error::NotApplicable`), the first in this order.
/// `max_shard_size` makes the run a re-sharding; a folder of files is a folder run.
pub fn check_applies(src: &Path, given: &[OptionName]) -> crate::Result<()> {
    use crate::error::{Error, Inapplicable as Why};
    use OptionName::{Config, Exclude, Include, Key, MaxShardSize, Name, Resume, Shard};
    let has = |option| given.contains(&option);
    let refuse = |option, why| {
        Err(Error::NotApplicable {
            option,
            src: src.to_path_buf(),
            why,
        })
    };
    if has(Name) && !has(MaxShardSize) {
        return refuse(Name, Why::NotResharded);
    }
    let tree = src.is_dir() && !crate::input::folder::check_folder(src, false)?;
    if let Some(&o) = [Include, Exclude].iter().find(|&&o| has(o) && !tree) {
        return refuse(o, Why::NotAFolderOfFiles);
    }
    if tree || has(MaxShardSize) {
        if tree && has(Key) {
            return refuse(Key, Why::FolderOfFiles);
        }
        if has(Config) && (tree || has(Shard)) {
            return refuse(
                Config,
                if tree {
                    Why::FolderOfFiles
                } else {
                    Why::InShards
                },
            );
        }
    } else if let Some(&o) = [Resume, Shard].iter().find(|&&o| has(o)) {
        return refuse(
            o,
            if src.is_dir() {
                Why::OneFile
            } else {
                Why::NotAFolder
            },
        );
    }
    Ok(())
}

impl Settings {
    /// The target `to` names (BF16 when not given).
    pub fn target(&self) -> crate::Result<Target> {
        self.to.as_ref().map_or(Ok(Target::Bf16), Given::target)
    }

    /// The names of the options set (not at their default) that `check_applies` asks of.
    pub fn set(&self) -> Vec<OptionName> {
        use OptionName::{Config, Exclude, Include, Key, MaxShardSize, Name, Resume, Shard};
        let set = [
            (Name, self.name.is_some()),
            (Include, !self.include.is_empty()),
            (Exclude, !self.exclude.is_empty()),
            (Key, self.key.is_some()),
            (Config, self.config.is_some()),
            (MaxShardSize, self.max_shard_size.is_some()),
            (Resume, self.resume),
            (Shard, self.shard.is_some()),
        ];
        set.into_iter()
            .filter(|&(_, s)| s)
            .map(|(o, _)| o)
            .collect()
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
    pub reasons: Names,
    pub kept_reasons: Names,
    pub error_kinds: Names,
    pub warning_kinds: Names,
    /// Every option of every command (`options::rows`).
    pub options: Vec<crate::options::Row>,
    pub input_formats: Names,
    pub on_overflow: Names,
    pub read_advice: Names,
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
        Exports {
            targets: Names::of(Target::NAMES),
            target_aliases: Target::ALIASES
                .iter()
                .map(|(a, t)| (*a, t.name()))
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
            options: crate::options::rows(),
            input_formats: Names::of(InputFormat::NAMES),
            on_overflow: Names::of(OnOverflow::NAMES),
            read_advice: Names::of(ReadAdvice::NAMES),
        }
    }
}

/// Every option of an engine call as a front end gave it (absent: the default), made once
/// into the engine's options of a plan, a conversion or a verification. Values are checked
/// here (`Given`), as usage errors naming the option.
#[derive(Clone, Debug)]
pub struct Settings {
    pub to: Option<Given>,
    pub threads: Option<Given>,
    pub force: bool,
    pub keep: Vec<String>,
    pub keep_min_size: Option<Given>,
    pub keep_unmatched: Unmatched,
    /// A `keep` pattern that matches nothing is an error (`Unmatched::Error`, where it would
    /// be a warning), in a conversion and its dry run.
    pub strict: bool,
    pub from_bf16: bool,
    /// The tensors a read before planning found to overflow, under `on_overflow` keep (a
    /// folder run's): kept, and not read for again. None: the task reads them.
    pub keep_names: Option<Vec<String>>,
    pub on_overflow: Option<Given>,
    /// inspect: read the tensors to convert and measure what converting them loses.
    pub scan: bool,
    pub numerics: bool,
    pub report: Option<PathBuf>,
    /// A lone checkpoint's model config, written beside its output (`convert::Options`).
    pub config: Option<PathBuf>,
    pub replaces: Option<(u64, u64)>,
    pub allow_copy: bool,
    pub key: Option<String>,
    pub strip_prefix: Vec<String>,
    pub loose: bool,
    /// None: not said (a plain inspection then only warns of a quantized checkpoint).
    pub allow_quantized: Option<bool>,
    pub quantization_config: Option<PathBuf>,
    /// A folder run's model config: whose `quantization_config` describes the packed
    /// weights it dequantizes (`quant::Schemes`), or under an FP8 target whose sizes its
    /// fused experts are split by (`experts`).
    pub packed_config: Option<PathBuf>,
    pub follow_links: bool,
    /// FP8 targets: the weights a read before planning found to hold NaN or inf (a
    /// re-sharded group's, read once for all its shards). None: the task reads them.
    pub unquantized: Option<Vec<String>>,
    /// A re-sharding's output stem (`convert --name`), for the record.
    pub name: Option<String>,
    /// Record nothing in the output's `__metadata__` (`record`): it is the input's.
    pub no_record: bool,
    /// A folder run's overrides of what it copies (`run::walk::Overrides`), for the record.
    pub include: Vec<String>,
    pub exclude: Vec<String>,
    /// verify: DST is a lone checkpoint's output (`VerifyOptions::lone`).
    pub lone: bool,
    /// A folder run: re-shard into output shards of at most this size.
    pub max_shard_size: Option<Given>,
    /// A folder run: convert only the I-th of N shard runs' units.
    pub shard: Option<ShardGiven>,
    /// A folder run: go on from an interrupted one.
    pub resume: bool,
}

/// `shard` as the caller gave it: its two numbers (None: not two whole numbers), and how the
/// caller wrote it (for the message).
#[derive(Debug, Clone)]
pub struct ShardGiven {
    /// Its numbers, each held to i128's range.
    pub parts: Option<(i128, i128)>,
    /// Its numbers as the caller's language writes whole numbers, `I/N` (for a message).
    pub numbers: String,
    pub repr: String,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            to: None,
            threads: None,
            force: false,
            keep: Vec::new(),
            keep_min_size: None,
            keep_unmatched: Unmatched::Warn,
            strict: false,
            from_bf16: false,
            keep_names: None,
            on_overflow: None,
            scan: false,
            numerics: true,
            report: None,
            config: None,
            replaces: None,
            allow_copy: false,
            key: None,
            strip_prefix: Vec::new(),
            loose: false,
            allow_quantized: None,
            quantization_config: None,
            packed_config: None,
            follow_links: false,
            unquantized: None,
            name: None,
            no_record: false,
            include: Vec::new(),
            exclude: Vec::new(),
            lone: false,
            max_shard_size: None,
            shard: None,
            resume: false,
        }
    }
}

impl Settings {
    /// How the input is read (a PyTorch checkpoint's dict, a checkpoint folder's links,
    /// under an FP8 target the model config's sizes fused experts are split by).
    pub fn input(&self) -> crate::Result<InputOptions> {
        let input = InputOptions {
            key: self.key.clone(),
            strip_prefix: self.strip_prefix.clone(),
            follow_links: self.follow_links,
            ..InputOptions::default()
        };
        Ok(input.with_experts(self.experts()?, &self.keep))
    }

    /// Under an FP8 target, what the model config (a lone file's `config`, a folder run's
    /// `packed_config`) says of its experts' sizes (`experts::Model`); None otherwise. A
    /// folder run's config must also declare experts (`experts::Model::of_folder_config`):
    /// then every output of the run records their sizes, whichever file splits them.
    fn experts(&self) -> crate::Result<Option<crate::experts::Model>> {
        if !self.fp8()? {
            return Ok(None);
        }
        if let Some(path) = self.config.as_deref() {
            let text = read_config(path)?;
            return crate::experts::Model::of_config(&text).map_err(|e| config_error(path, &e));
        }
        self.folder_experts()
    }

    /// Under an FP8 target, the sizes a folder run's model config (`packed_config`) gives
    /// experts it declares: what each of the run's outputs records.
    fn folder_experts(&self) -> crate::Result<Option<crate::experts::Model>> {
        let (true, None, Some(path)) = (self.fp8()?, &self.config, &self.packed_config) else {
            return Ok(None);
        };
        let text = read_config(path)?;
        crate::experts::Model::of_folder_config(&text).map_err(|e| config_error(path, &e))
    }

    /// Is the target an FP8 one?
    fn fp8(&self) -> crate::Result<bool> {
        let target = self.target()?;
        Ok(target.strategy().is_some())
    }

    /// A re-sharding's output shard size (None: not re-sharded).
    pub fn max_shard_size(&self) -> crate::Result<Option<u64>> {
        self.max_shard_size.as_ref().map(Given::size).transpose()
    }

    pub fn on_overflow(&self) -> crate::Result<OnOverflow> {
        self.on_overflow
            .as_ref()
            .map_or(Ok(OnOverflow::Warn), Given::on_overflow)
    }

    fn threads(&self) -> crate::Result<usize> {
        self.threads.as_ref().map_or(Ok(0), Given::threads)
    }

    /// What an output records of these options (`record::Record`); None under `no_record`.
    pub fn record(&self) -> crate::Result<Option<String>> {
        if self.no_record {
            return Ok(None);
        }
        let plan = self.plan_only()?;
        let record = Record {
            keep: plan.keep,
            keep_min_size: plan.keep_min_size,
            from_bf16: plan.from_bf16,
            key: self.key.clone(),
            strip_prefix: self.strip_prefix.clone(),
            name: self.name.clone(),
            include: self.include.clone(),
            exclude: self.exclude.clone(),
            experts: self.folder_experts()?.map(|m| m.sizes()),
            config: self.config.is_some(),
            ..Record::new(plan.target)
        };
        Ok(Some(record.with_on_overflow(self.on_overflow()?).text()))
    }

    /// The options that decide a plan, the record included.
    pub fn plan(&self) -> crate::Result<PlanOptions> {
        Ok(PlanOptions {
            record: self.record()?,
            ..self.plan_only()?
        })
    }

    /// The options that decide a plan but the record.
    fn plan_only(&self) -> crate::Result<PlanOptions> {
        let keep_min_size = match &self.keep_min_size {
            Some(g) => g.whole(OptionName::KeepMinSize, u64::MAX)?,
            None => 0,
        };
        let target = self.target()?;
        Ok(PlanOptions {
            keep: self.keep.clone(),
            keep_min_size,
            from_bf16: self.from_bf16,
            keep_names: self.keep_names.iter().flatten().cloned().collect(),
            // (`strict` makes the warning an error; a caller that ignores them still does.)
            unmatched: match self.keep_unmatched {
                Unmatched::Warn if self.strict => Unmatched::Error,
                unmatched => unmatched,
            },
            allow_quantized: self.allow_quantized.unwrap_or(false),
            quantization_config: self.quantization_config.clone(),
            // (Under an FP8 target nothing is dequantized: `packed_config` is the model
            // config fused experts are split by.)
            schemes: match self.fp8()? {
                false => self.packed_config.as_deref().map(schemes).transpose()?,
                true => None,
            },
            unquantized: self
                .unquantized
                .as_ref()
                .map(|u| u.iter().cloned().collect()),
            experts: self.experts()?,
            ..PlanOptions::new(target)
        })
    }

    /// The options of a conversion (and of a dry run's checks).
    pub fn convert(&self, tuning: Tuning) -> crate::Result<Options> {
        Ok(Options {
            report: self.report.clone(),
            side_config: true,
            model_config: self.config.clone(),
            replaces: self.replaces,
            allow_copy: self.allow_copy,
            input: self.input()?,
            plan: self.plan()?,
            threads: self.threads()?,
            force: self.force,
            on_overflow: self.on_overflow()?,
            // The tensors that overflow are known already: the task does not read for them
            // (what `keep` keeps is in the plan, and in the record).
            overflow_known: self.keep_names.is_some(),
            numerics: self.numerics,
            tuning,
        })
    }

    /// The options of an inspection, a dry run when `dry_run` (a destination is given): a
    /// plain inspection only warns of a quantized checkpoint unless `allow_quantized` is
    /// said, and of patterns that match nothing whatever `strict` says; a dry run, or a
    /// caller that says it, is judged as the conversion would be.
    pub fn inspect(&self, tuning: Tuning, dry_run: bool) -> crate::Result<Options> {
        let mut s = self.clone();
        s.strict &= dry_run;
        let mut opts = s.convert(tuning)?;
        opts.plan.allow_quantized |= !dry_run && self.allow_quantized.is_none();
        Ok(opts)
    }

    /// The options of a verification (`to`: the target it must have, if given; the options
    /// not given are DST's record's).
    pub fn verify(&self, tuning: Tuning) -> crate::Result<VerifyOptions> {
        let plan = self.plan_only()?;
        Ok(VerifyOptions {
            // What `convert` read with `follow_links` is verified as it was read: verify
            // writes nothing of the source (a report holds numbers only).
            input: InputOptions {
                follow_links: true,
                ..self.input()?
            },
            loose: self.loose,
            target: self.to.as_ref().map(|_| plan.target),
            keep: plan.keep,
            keep_min_size: self.keep_min_size.as_ref().map(|_| plan.keep_min_size),
            from_bf16: self.from_bf16,
            on_overflow: self
                .on_overflow
                .as_ref()
                .map(Given::on_overflow)
                .transpose()?,
            threads: self.threads()?,
            numerics: self.numerics,
            report: self.report.clone(),
            force: self.force,
            tuning,
            allow_copy: self.allow_copy,
            lone: self.lone,
        })
    }

    /// These settings for a re-sharded group's work (`shard::Group`): it was opened with
    /// its input options, and its report (of unmatched tensors too) is the folder's.
    fn shard(&self) -> Settings {
        Settings {
            keep_unmatched: Unmatched::Ignore,
            key: None,
            strip_prefix: Vec::new(),
            report: None,
            allow_copy: true,
            lone: false,
            ..self.clone()
        }
    }

    /// The options of a re-sharded group's plan (`shard::Group::plan`): its record is of
    /// the options the group was opened with too.
    pub fn shard_plan(&self) -> crate::Result<PlanOptions> {
        Ok(PlanOptions {
            record: self.record()?,
            ..self.shard().plan()?
        })
    }

    /// The options of an output shard's conversion (`shard::Group::task`).
    pub fn shard_convert(&self, tuning: Tuning) -> crate::Result<Options> {
        let mut opts = self.shard().convert(tuning)?;
        opts.plan.record = self.record()?;
        Ok(Options {
            side_config: false,
            ..opts
        })
    }

    /// The options of an output shard's verification (`shard::Group::verifier`).
    pub fn shard_verify(&self, tuning: Tuning) -> crate::Result<VerifyOptions> {
        let force = false;
        Settings {
            force,
            ..self.shard()
        }
        .verify(tuning)
    }
}

/// The schemes model config `path` gives its packed weights (`Settings::packed_config`).
fn schemes(path: &std::path::Path) -> crate::Result<crate::quant::Schemes> {
    let text = read_config(path)?;
    let (groups, ignore) = crate::run::json::schemes(&text)
        .map_err(|e| config_error(path, &format!("not JSON (at byte {})", e.0)))?;
    Ok(crate::quant::Schemes {
        config: path.to_path_buf(),
        groups,
        ignore,
    })
}

/// The text of model config `path`.
fn read_config(path: &std::path::Path) -> crate::Result<String> {
    crate::run::json::read_model_config(path)
}

const READ_CONFIG: &str = "read the model config";

/// Model config `path` is not what it must be (`e` says why).
fn config_error(path: &std::path::Path, e: &dyn std::fmt::Display) -> crate::error::Error {
    let e = std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string());
    crate::error::Error::io(path, READ_CONFIG, e)
}

#[cfg(test)]
mod given_tests {
    use super::*;
    use crate::options::Checked;

    #[test]
    fn an_option_the_run_does_not_take_is_refused_naming_it_and_the_run() {
        use OptionName::*;
        let dir = std::env::temp_dir().join(format!("stcast-applies-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("m.safetensors"); // (need not exist: not a folder)
        let refused = |src: &Path, given: &[OptionName]| {
            let e = check_applies(src, given).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Usage);
            (e.option().unwrap(), e.template())
        };
        assert!(check_applies(&file, &[Key, Config, To, StripPrefix]).is_ok());
        assert!(check_applies(&file, &[MaxShardSize, Name, Resume, Shard]).is_ok());
        assert!(
            check_applies(&dir, &[Include, Exclude, Resume, Shard, Name, MaxShardSize]).is_ok()
        );
        let (o, m) = refused(&file, &[Name]);
        assert_eq!(o, Name);
        assert!(m.ends_with("it applies with {max_shard_size}"), "{m}");
        let (o, m) = refused(&file, &[Exclude]);
        assert_eq!(o, Exclude);
        assert!(m.contains("is one checkpoint"), "{m}");
        assert_eq!(refused(&dir, &[Key]).0, Key);
        assert!(refused(&dir, &[Config]).1.ends_with("is a folder of files"));
        let (o, m) = refused(&file, &[Config, Shard, MaxShardSize]);
        assert_eq!(o, Config);
        assert!(m.ends_with("is converted in shards ({shard})"), "{m}");
        let (o, m) = refused(&file, &[Shard]);
        assert_eq!(o, Shard);
        assert!(m.ends_with("is not one"), "{m}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn text(s: &str) -> Given {
        Given {
            text: Some(s.into()),
            repr: format!("'{s}'"),
            ..Given::default()
        }
    }

    #[test]
    fn a_resharded_group_keeps_its_own_input_report_and_unmatched() {
        let s = Settings {
            key: Some("model".into()),
            strip_prefix: vec!["module.".into()],
            report: Some("r.json".into()),
            force: true,
            ..Settings::default()
        };
        let c = s.shard_convert(Tuning::default()).unwrap();
        assert_eq!(c.input, InputOptions::default());
        assert_eq!((c.report, c.allow_copy, c.force), (None, true, true));
        assert_eq!(c.plan.unmatched, Unmatched::Ignore);
        assert_eq!(s.shard_plan().unwrap().unmatched, Unmatched::Ignore);
        let v = s.shard_verify(Tuning::default()).unwrap();
        // verify follows links, always (it writes nothing of the source).
        let followed = InputOptions {
            follow_links: true,
            ..InputOptions::default()
        };
        assert_eq!((v.input, v.report, v.force), (followed, None, false));
        // The plain options keep what was given.
        assert_eq!(
            s.convert(Tuning::default()).unwrap().input.key.as_deref(),
            Some("model")
        );
    }

    #[test]
    fn strict_makes_unmatched_patterns_an_error_but_in_a_plain_inspection() {
        let strict = Settings {
            strict: true,
            ..Settings::default()
        };
        let unmatched = |s: &Settings| s.convert(Tuning::default()).unwrap().plan.unmatched;
        assert_eq!(unmatched(&Settings::default()), Unmatched::Warn);
        assert_eq!(unmatched(&strict), Unmatched::Error);
        let inspected = |dry_run| strict.inspect(Tuning::default(), dry_run).unwrap();
        assert_eq!(inspected(true).plan.unmatched, Unmatched::Error);
        assert_eq!(inspected(false).plan.unmatched, Unmatched::Warn);
        // A caller that ignores them (a folder's files) still does.
        let ignored = Settings {
            keep_unmatched: Unmatched::Ignore,
            ..strict.clone()
        };
        assert_eq!(unmatched(&ignored), Unmatched::Ignore);
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

    #[test]
    fn checks_each_option_by_its_kind() {
        let def = |n| crate::options::find(n).unwrap();
        let whole = |n| Given {
            whole: Some(n),
            repr: n.to_string(),
            ..Given::default()
        };
        let max = crate::window::MAX_THREADS as u64;
        assert_eq!(
            whole(max).check(def("threads")).unwrap(),
            Some(Checked::Whole(max))
        );
        let e = whole(max + 1)
            .check(def("threads"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("a whole number from 0 to {max}")),
            "{e}"
        );
        let big = whole(u64::MAX).check(def("keep_min_size")).unwrap();
        assert_eq!(big, Some(Checked::Whole(u64::MAX)));
        let half = text("half").check(def("to")).unwrap();
        assert_eq!(half, Some(Checked::Text("fp16".into())));
        assert_eq!(
            text("5kB").check(def("max_shard_size")).unwrap(),
            Some(Checked::Whole(5000))
        );
        assert!(text("never").check(def("on_overflow")).is_err());
        let keep = text("keep").check(def("on_overflow")).unwrap();
        assert_eq!(keep, Some(Checked::Text("keep".into())));
        let e = text("").check(def("strip_prefix")).unwrap_err().to_string();
        assert!(e.contains("a non-empty string (a name prefix)"), "{e}");
        assert!(text("").check(def("keep")).is_ok());
        let e = whole(3).check(def("key")).unwrap_err().to_string();
        assert!(
            e.contains("a string (a dotted key of the checkpoint)"),
            "{e}"
        );
        assert!(text("a/b").check(def("name")).is_err());
        // Not checked here: switches, I/N, paths, tuning, the CLI's own options.
        for name in ["force", "shard", "report", "tuning", "quiet"] {
            assert_eq!(text("x").check(def(name)).unwrap(), None, "{name}");
        }
    }
}
