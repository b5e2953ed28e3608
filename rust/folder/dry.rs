//! A folder run's dry run, whole (`DryRun`, stepped): where the run reads (a cache repo
//! root's snapshot); with a destination, every check the run makes (`prepare::PrepareTask`,
//! what they say collected, not told, but for the keep patterns, judged again over the files
//! inspected) and its numeric report's path; each weight file inspected
//! (`inspect::InspectFolderTask`); and for a re-sharding the plan of its output shards
//! (`work::Work`: the checked run's, or without a destination planned as the run cuts it
//! from what the files' inspection read: the tensors kept from overflow, under an FP8 target
//! the weights holding NaN or inf), its outputs counted to the byte.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::inspect::{FolderInspection, InspectFolderTask, Planning};
use super::prepare::{Asked, PrepareTask, Prepared};
use super::work::{Cut, Work, WorkTask};
use crate::convert::Tuning;
use crate::error::Result;
use crate::given::Settings;
use crate::output;
use crate::run::place::{self, SourceKind};
use crate::run::survey::Kind;
use crate::task::{Said, Task};
use crate::vocab::{Fp8Skip, ReasonCode, WarningKind};

/// The steps of a `DryRun`.
enum Stage {
    /// The run's checks (a destination given).
    Checks(Box<PrepareTask>),
    /// Checked: the numeric report's path next.
    Prepared(Box<Prepared>),
    /// The folder walked or planned.
    Planning(Box<Planning>),
    /// Each weight file inspected: the progress told.
    Inspect(Box<InspectFolderTask>),
    /// Inspected, its end told.
    Inspected(Box<InspectFolderTask>),
    /// A re-sharding's plan, without a destination.
    Work(Box<WorkTask>),
    Done,
    /// Between steps.
    Empty,
}

/// A folder run's dry run, stepped; `finish` gives the answer.
pub struct DryRun {
    stage: Stage,
    /// The source read (a cache repo root's snapshot).
    src: PathBuf,
    given: Settings,
    tuning: Tuning,
    resharding: bool,
    /// A destination was given: the run's checks are made.
    checking: bool,
    /// What the run's checks said.
    checked: Vec<Said>,
    work: Option<Arc<Work>>,
    found: Option<FolderInspection>,
}

/// A dry run's answer.
pub struct Dry {
    /// The source read.
    pub src: PathBuf,
    /// The inspection, its warnings the run's checks' too (and a re-sharding's plan's), its
    /// output bytes a re-sharding's outputs'.
    pub found: FolderInspection,
    /// A re-sharding's plan.
    pub work: Option<Arc<Work>>,
}

impl DryRun {
    /// The dry run of `src` into `dst` (None: no checks) with the options `s`.
    pub fn new(src: &Path, dst: Option<&Path>, s: &Settings, tuning: Tuning) -> Result<DryRun> {
        let target = s.target()?;
        let resharding = s.max_shard_size()?.is_some();
        let src = place::place(src, dst, target, resharding, false)?.src;
        let mut dry = DryRun {
            stage: Stage::Empty,
            src,
            given: s.clone(),
            tuning,
            resharding,
            checking: dst.is_some(),
            checked: Vec::new(),
            work: None,
            found: None,
        };
        dry.stage = match dst {
            Some(dst) => {
                let asked = Asked::new(&dry.src, Some(dst), s);
                Stage::Checks(Box::new(PrepareTask::new(asked)?))
            }
            None => Stage::Planning(Box::new(dry.planning(false)?)),
        };
        Ok(dry)
    }

    /// The folder walked, or with `checked` planned as the run plans it.
    fn planning(&self, checked: bool) -> Result<Planning> {
        let s = Settings {
            force: false,
            strict: false,
            name: None,
            report: None,
            allow_quantized: Some(self.given.allow_quantized.unwrap_or(false)),
            max_shard_size: None,
            shard: None,
            resume: false,
            ..self.given.clone()
        };
        let (scan, tuning) = (s.scan, self.tuning.clone());
        Planning::new(&self.src, &s, tuning, scan, checked, self.resharding)
    }

    /// A re-sharding's plan, as the run cuts it, from what the files' inspection read.
    fn cut(&self, found: &FolderInspection) -> Result<WorkTask> {
        let s = &self.given;
        let single = place::source(&self.src, true)? != SourceKind::Tree;
        let plan = Settings {
            threads: None,
            force: false,
            strict: false,
            scan: false,
            report: None,
            allow_quantized: None,
            config: s.config.clone().filter(|_| single),
            max_shard_size: None,
            shard: None,
            resume: false,
            ..s.clone()
        };
        let names = |keep: &dyn Fn(ReasonCode, Option<Fp8Skip>) -> bool| {
            let files = found.files.iter().map(|(_, f)| {
                let rows = f.rows();
                let kept = rows
                    .tensors
                    .iter()
                    .filter(|t| keep(t.reason, t.not_quantized));
                kept.map(|t| t.name.to_string()).collect()
            });
            files.collect::<Vec<Vec<String>>>()
        };
        let fp8 = found.rows.to.strategy().is_some();
        let cut = Cut {
            max_size: s.max_shard_size()?.unwrap_or(u64::MAX),
            follow_links: s.follow_links,
            keep_names: Some(names(&|r, _| r == ReasonCode::KeepOverflow)),
            unquantized: fp8.then(|| names(&|_, n| n == Some(Fp8Skip::NonFinite))),
        };
        WorkTask::new(&self.src, &plan, false, single, Some(cut), None)
    }

    /// The answer, once every step is done: the checks' warnings after those of the keep
    /// patterns that match no tensor; a re-sharding's plan's (without a destination: those
    /// the files' did not say), and its outputs counted.
    pub fn finish(self) -> Result<Dry> {
        let (Stage::Done, Some(mut found)) = (self.stage, self.found) else {
            unreachable!("finish before the last step");
        };
        let said = &mut found.named.2;
        let first = usize::from(!found.rows.keep_unmatched.is_empty());
        let told = |(w, at): Said| (w.kind.name(), w.text, at);
        let checked = self.checked.into_iter().map(told);
        said.splice(first..first, checked);
        if let Some(work) = &self.work {
            if !self.checking {
                let before = said.clone();
                let planned = work.warnings.iter().cloned().map(told);
                said.extend(planned.filter(|n| !before.contains(n)));
            }
            let written = work.outputs();
            let size = |weights: bool| -> u64 {
                let mine = written
                    .iter()
                    .filter(|(_, k, _)| (*k == Kind::Weights) == weights);
                mine.map(|(_, _, size)| size).sum()
            };
            found.rows.other_bytes = size(false);
            found.rows.output_bytes = size(true) + size(false);
        }
        Ok(Dry {
            src: self.src,
            found,
            work: self.work,
        })
    }
}

impl Task for DryRun {
    fn step(&mut self, budget: u64) -> Result<bool> {
        self.stage = match std::mem::replace(&mut self.stage, Stage::Empty) {
            Stage::Checks(mut task) => {
                let done = task.step(budget)?;
                // (A keep pattern's is judged again over the files inspected.)
                let said = task.take_said().into_iter();
                let kept = said.filter(|(w, _)| w.kind != WarningKind::UnmatchedPattern);
                self.checked.extend(kept);
                match done {
                    true => Stage::Prepared(Box::new(task.finish()?)),
                    false => Stage::Checks(task),
                }
            }
            Stage::Prepared(p) => {
                if let Some(path) = &self.given.report {
                    // As the run checks it.
                    output::check_report_path(path, p.force, &p.src, &p.dst)?;
                }
                if self.resharding {
                    self.work = Some(Arc::clone(&p.work));
                }
                Stage::Planning(Box::new(self.planning(true)?))
            }
            Stage::Planning(mut task) => match task.step(budget)? {
                true => Stage::Inspect(Box::new(InspectFolderTask::new(*task)?)),
                false => Stage::Planning(task),
            },
            Stage::Inspect(mut task) => match task.step(budget)? {
                true => Stage::Inspected(task),
                false => Stage::Inspect(task),
            },
            Stage::Inspected(task) => {
                let found = task.finish()?;
                let next = match (self.resharding, &self.work) {
                    (true, None) => Stage::Work(Box::new(self.cut(&found)?)),
                    _ => Stage::Done,
                };
                self.found = Some(found);
                next
            }
            Stage::Work(mut task) => match task.step(budget)? {
                true => {
                    self.work = Some(Arc::new(task.finish()?));
                    Stage::Done
                }
                false => Stage::Work(task),
            },
            Stage::Done => Stage::Done,
            Stage::Empty => unreachable!("a step after a failure"),
        };
        Ok(matches!(self.stage, Stage::Done))
    }

    /// The inspection's (a scan's bytes over every file).
    fn progress(&self) -> (u64, u64) {
        match &self.stage {
            Stage::Inspect(task) | Stage::Inspected(task) => task.progress(),
            _ => (0, 0),
        }
    }

    /// Only the inspection tells its progress: the checks and plans read headers.
    fn measured(&self) -> bool {
        matches!(self.stage, Stage::Inspect(_) | Stage::Inspected(_))
    }
}
