//! A folder run, whole (`RunTask`, stepped): every check (`prepare::PrepareTask`, its
//! warnings told as they are said), then the numeric report's path (`report`: refused before
//! any byte is written), the writing (`write::ConvertFolderTask`), and once the run is
//! complete, the numeric report (`RunTask::finish`), whose failure comes after the run's
//! commit point and says so.

use std::path::{Path, PathBuf};

use super::finish::{Converted, FolderReport};
use super::prepare::{Asked, PrepareTask, Prepared};
use super::write::ConvertFolderTask;
use crate::convert::Tuning;
use crate::error::{Error, Result};
use crate::given::{Given, Settings};
use crate::output::{self, Replace};
use crate::task::{Said, Task};

/// The steps of a `RunTask`.
enum Stage {
    Prepare(Box<PrepareTask>),
    /// Every check made: the numeric report's path checked next.
    Prepared(Box<Prepared>),
    Write(Box<ConvertFolderTask>),
    /// Between steps.
    Empty,
}

/// A folder run from its question to its report, stepped; `finish` gives the report.
pub struct RunTask {
    stage: Stage,
    /// Where the numeric report goes (`report`), and how it is published there.
    report: Option<(PathBuf, Replace)>,
    /// The call's `threads` and tuning (the rest is the plan's).
    threads: Option<Given>,
    tuning: Tuning,
    /// The checks' warnings not taken yet (`take_said`).
    said: Vec<Said>,
}

impl RunTask {
    /// The run of `src` into `dst` (None: the default destination) with the options `s`,
    /// its first checks made (`PrepareTask::new`).
    pub fn new(src: &Path, dst: Option<&Path>, s: &Settings, tuning: Tuning) -> Result<RunTask> {
        let asked = Asked::new(src, dst, s);
        Ok(RunTask {
            stage: Stage::Prepare(Box::new(PrepareTask::new(asked)?)),
            report: s.report.clone().map(|path| (path, Replace::No)),
            threads: s.threads.clone(),
            tuning,
            said: Vec::new(),
        })
    }

    /// The run's report and the units it converted, once every step is done; first its
    /// numeric report is written, if asked and every unit converted measured its numerics.
    /// A failure then comes after the run's commit point (`Error::AfterCommit`).
    pub fn finish(self) -> Result<(FolderReport, Vec<Converted>)> {
        let Stage::Write(task) = self.stage else {
            unreachable!("finish before the last step");
        };
        let (report, converted) = task.finish();
        if let (Some((path, replace)), Some(_)) = (&self.report, &report.numerics) {
            let names: Vec<String> = (converted.iter())
                .map(|c| c.rel.to_string_lossy().into_owned())
                .collect();
            let parts: Vec<_> = (names.iter().zip(&converted))
                .map(|(name, c)| {
                    let r = &c.report;
                    (
                        Some(name.as_str()),
                        &r.numerics[..],
                        &r.numerics_total,
                        &r.dequantized[..],
                    )
                })
                .collect();
            let bytes =
                crate::report::files_report(&report.src, &report.dst, Some(report.to), &parts);
            output::write_file(path, &bytes, *replace, "").map_err(|e| Error::AfterCommit {
                published: report.dst.clone(),
                source: Box::new(e),
                folder: true,
            })?;
        }
        Ok((report, converted))
    }
}

impl Task for RunTask {
    fn step(&mut self, budget: u64) -> Result<bool> {
        self.stage = match std::mem::replace(&mut self.stage, Stage::Empty) {
            Stage::Prepare(mut task) => {
                let done = task.step(budget)?;
                self.said.extend(task.take_said());
                match done {
                    true => Stage::Prepared(Box::new(task.finish()?)),
                    false => Stage::Prepare(task),
                }
            }
            Stage::Prepared(p) => {
                if let Some((path, replace)) = &mut self.report {
                    *replace = output::check_report_path(path, p.force, &p.src, &p.dst)?;
                }
                let (threads, tuning) = (self.threads.clone(), self.tuning.clone());
                Stage::Write(Box::new(ConvertFolderTask::new(*p, threads, tuning)))
            }
            Stage::Write(mut task) => {
                let done = task.step(budget);
                self.stage = Stage::Write(task);
                return done;
            }
            Stage::Empty => unreachable!("a step after a failure"),
        };
        Ok(false)
    }

    fn progress(&self) -> (u64, u64) {
        match &self.stage {
            Stage::Write(task) => task.progress(),
            _ => (0, 0),
        }
    }

    fn take_said(&mut self) -> Vec<Said> {
        let mut said = std::mem::take(&mut self.said);
        if let Stage::Write(task) = &mut self.stage {
            said.extend(task.take_said());
        }
        said
    }

    fn failed(&mut self, e: Error) -> Error {
        match &mut self.stage {
            Stage::Write(task) => task.failed(e),
            _ => e,
        }
    }

    fn file_progress(&self) -> Option<(&std::ffi::OsStr, u64, u64)> {
        match &self.stage {
            Stage::Write(task) => task.file_progress(),
            _ => None,
        }
    }
}
