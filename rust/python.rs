//! The PyO3 adapter: argument conversion, GIL release in bounded steps, error mapping.
//!
//! It holds no logic of its own: it converts arguments into engine options, steps an engine
//! task with the GIL released (checking signals, the cancel flag and progress between
//! steps), and converts what the engine returns into plain Python data. Exceptions are the
//! classes `stcast.errors` hands over at import, one per `vocab::ErrorKind` (`to_py`).

#![allow(clippy::too_many_arguments, reason = "pyfunctions mirror Python calls")]

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use pyo3::exceptions::{PyIndexError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{IntoPyDict, PyDict};

use crate::convert::{Knobs, Options as ConvertOptions, Tuning};
use crate::error::{panic_message, Error};
use crate::folder::inspect::{InspectFolderTask, Planning};
use crate::folder::verify_folder::FolderVerify;
use crate::folder::work::{Cut, Judged, Unit, Work, WorkTask};
use crate::given::{Exports, Given, Settings};
use crate::numerics::{DequantizedTensor, Numerics};
use crate::options;
use crate::output::{self, Replace, Sealed};
use crate::report::NumericsRow;
use crate::run::{fp8config, json, manifest, place, publish, survey, walk};
use crate::task::{ConvertTask, InspectTask, Inspection, Task};
use crate::text;
use crate::verify::{Verifier, VerifyOptions, VerifyReport};
use crate::vocab::{ErrorKind, OptionName, Side, Taken, Target, Unmatched};
use crate::{Result, VERSION};

/// What `stcast.errors` hands over at import (`_set_exceptions`), in `ErrorKind::ALL`
/// order: for each error kind, the class (or, for `io` and `cancelled`, the factory) of its
/// exception, called as `f(template, *, message, path, tensor, option, errno)`.
static EXCEPTIONS: PyOnceLock<Vec<Py<PyAny>>> = PyOnceLock::new();

/// Called once, by `stcast.errors` with each kind by name (a second call keeps the first).
#[pyfunction]
fn _set_exceptions(py: Python<'_>, classes: &Bound<'_, PyAny>) -> PyResult<()> {
    let class = |k: &ErrorKind| Ok(classes.get_item(k.name())?.unbind());
    let all = ErrorKind::ALL.iter().map(class).collect::<PyResult<_>>()?;
    let _ = EXCEPTIONS.set(py, all);
    Ok(())
}

/// The Python exception for an engine error (a Ctrl-C that arrived meanwhile wins, unless
/// the error came after the commit point).
fn to_py(py: Python<'_>, e: Error) -> PyErr {
    if !matches!(e, Error::AfterCommit { .. }) {
        if let Err(interrupt) = py.check_signals() {
            return interrupt;
        }
    }
    let build = || -> PyResult<PyErr> {
        let Some(x) = EXCEPTIONS.get(py) else {
            return Ok(PyRuntimeError::new_err(e.message()));
        };
        let class = &x[e.kind() as usize];
        let option = e.option().map(OptionName::name);
        let kwargs = [
            ("message", e.message().into_pyobject(py)?.into_any()),
            ("path", e.path().map(|p| p.as_os_str()).into_pyobject(py)?),
            ("tensor", e.tensor().into_pyobject(py)?),
            ("option", option.into_pyobject(py)?),
            ("errno", e.errno().into_pyobject(py)?),
        ]
        .into_py_dict(py)?;
        let exc = class.bind(py).call((e.template(),), Some(&kwargs))?;
        Ok(PyErr::from_value(exc))
    };
    build().unwrap_or_else(|failed| failed)
}

/// Run engine work without the GIL; a panic becomes a one-line Python error.
fn guarded<T: Send>(py: Python<'_>, f: impl FnOnce() -> Result<T> + Send) -> PyResult<T> {
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(py, e)),
        Err(panic) => Err(PyRuntimeError::new_err(panic_message(&*panic))),
    }
}

/// A callback the caller may give (`progress`, `cancel`, `warn`, `sealed`).
type Hook<'py> = Option<Bound<'py, PyAny>>;

/// The callbacks of a call, which a task reports to between steps.
struct Hooks<'py> {
    progress: Hook<'py>,
    cancel: Hook<'py>,
    warn: Hook<'py>,
    /// Told a sealed output's (dev, ino, size, header hash) before it is published.
    sealed: Hook<'py>,
    /// `progress` was told `(total, total)`: the visits after the last step (sealing,
    /// publishing) do not tell it again, so that a caller hears of the end once.
    ended: Cell<bool>,
    /// The folder run this call writes for: its manifest claims each output before it has a
    /// name, and its failures are told as the run sees them (`publish::Writer::rival`).
    run: Option<Py<FolderRun>>,
    /// Converting one of that run's weights: a failure may roll the run back
    /// (`publish::Writer::failed`).
    converting: bool,
}

impl<'py> Hooks<'py> {
    /// The callbacks as the call was given them (None: not given).
    fn new(progress: Hook<'py>, cancel: Hook<'py>, warn: Hook<'py>, sealed: Hook<'py>) -> Self {
        Hooks {
            progress,
            cancel,
            warn,
            sealed,
            ended: Cell::new(false),
            run: None,
            converting: false,
        }
    }

    /// The same, writing for the folder run `run` (`converting`: one of its weights).
    fn writing(self, run: &Bound<'py, FolderRun>, converting: bool) -> Self {
        let run = Some(run.clone().unbind());
        Hooks {
            run,
            converting,
            ..self
        }
    }

    /// Ctrl-C, the cancel flag, warnings, then progress (any of which may raise).
    fn visit(&self, py: Python<'py>, task: &mut impl Task) -> PyResult<()> {
        py.check_signals()?;
        if self.cancelled()? {
            return Err(to_py(py, Error::Cancelled));
        }
        for w in task.take_warnings() {
            if let Some(f) = &self.warn {
                f.call1((w.kind.name(), &w.text))?;
            }
        }
        if let Some(p) = self.progress.as_ref().filter(|_| !self.ended.get()) {
            let (done, total) = task.progress();
            self.ended.set(done >= total);
            p.call1((done, total))?;
        }
        Ok(())
    }

    /// Step `task` to its end, `step` source bytes at a time (`Tuning::step`), visiting
    /// Python between steps.
    fn drive(&self, py: Python<'py>, task: &mut (impl Task + Send), step: u64) -> PyResult<()> {
        self.visit(py, task)?;
        while !self.run(py, || task.step(step))? {
            self.visit(py, task)?;
        }
        self.visit(py, task)
    }

    /// `guarded`, where a stop request that arrived meanwhile (a signal the caller's
    /// handler recorded, the cancel flag) wins over the error it caused (EINTR, say); not
    /// over a failure after the commit point, which must be told as such.
    fn run<T: Send>(&self, py: Python<'py>, f: impl FnOnce() -> Result<T> + Send) -> PyResult<T> {
        let mut after_commit = false;
        let run = self.run.as_ref().map(|r| &r.get().0);
        let f = || {
            f().map_err(|e| match run {
                Some(w) => writer(w).rival(e),
                None => e,
            })
            .inspect_err(|e| after_commit = matches!(e, Error::AfterCommit { .. }))
        };
        let e = match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => e,
            Err(panic) => return Err(PyRuntimeError::new_err(panic_message(&*panic))),
        };
        if !after_commit {
            py.check_signals()?;
            if self.cancelled().unwrap_or(false) {
                return Err(to_py(py, Error::Cancelled));
            }
        }
        let e = match run.filter(|_| self.converting) {
            Some(w) => py.detach(|| writer(w).failed(e)),
            None => e,
        };
        Err(to_py(py, e))
    }

    /// Publish a sealed output (the commit point), telling `sealed` (if given) its (dev, ino,
    /// size, header hash or None) first: a folder run records them in its manifest before the
    /// file has a name. If that raises, or a stop request comes meanwhile, nothing is published.
    /// Writing for a folder run (`writing`), `out` is its file `rel`: the run's manifest
    /// claims it instead, then the failpoint `point` (if any) is hit.
    fn publish<S: Sealed<Done: Send> + Send>(
        &self,
        py: Python<'py>,
        out: S,
        rel: Option<(&OsStr, Option<&str>)>,
    ) -> PyResult<S::Done> {
        if let (Some(run), Some((rel, point))) = (&self.run, rel) {
            let w = &run.get().0;
            let (id, header) = (out.identity(), out.header_sha256());
            let id = id.map_err(|e| to_py(py, e))?;
            self.run(py, || writer(w).claim_as(rel, id, header))?;
            if let Some(name) = point {
                self.run(py, || failpoint_hit(name))?;
            }
            py.check_signals()?;
            if self.cancelled()? {
                return Err(to_py(py, Error::Cancelled));
            }
        } else if let Some(f) = &self.sealed {
            let id = out.identity().map_err(|e| to_py(py, e))?;
            f.call1((id.dev, id.ino, id.size, out.header_sha256()))?;
            py.check_signals()?;
            if self.cancelled()? {
                return Err(to_py(py, Error::Cancelled));
            }
        }
        self.run(py, move || out.publish())
    }

    /// Whether the caller's cancel flag is set.
    fn cancelled(&self) -> PyResult<bool> {
        self.cancel
            .as_ref()
            .map_or(Ok(false), |c| c.call_method0("is_set")?.is_truthy())
    }
}

/// A Python value as the engine checks an option's value (`given::Given`).
impl FromPyObject<'_, '_> for Given {
    type Error = PyErr;
    fn extract(v: Borrowed<'_, '_, PyAny>) -> PyResult<Given> {
        let repr = v.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
        let is_bool = v.is_instance_of::<pyo3::types::PyBool>();
        Ok(Given {
            text: v.extract().ok(),
            whole: if is_bool { None } else { v.extract().ok() },
            repr,
        })
    }
}

/// A name of the engine's vocabulary (`from_name`) as an argument; another name is a
/// ValueError saying what it is for, with the names.
macro_rules! named {
    ($($ty:ident: $what:literal),* $(,)?) => {$(
        impl FromPyObject<'_, '_> for $ty {
            type Error = PyErr;
            fn extract(v: Borrowed<'_, '_, PyAny>) -> PyResult<$ty> {
                let msg = || format!(concat!($what, " {:?}"), $ty::NAMES);
                let name = v.extract::<String>()?;
                $ty::from_name(&name).ok_or_else(|| PyValueError::new_err(msg()))
            }
        }
    )*};
}

named! {
    Unmatched: "keep_unmatched must be one of", Side: "role: one of", Taken: "taken: one of",
    Target: "to: one of",
}

/// The knobs of `tuning=` (`convert::Knobs`, `Tuning::new`): speed and memory, never the bytes.
fn tuning(v: Option<&Bound<'_, PyDict>>) -> PyResult<Tuning> {
    let knobs: Knobs = match v {
        None => Knobs::default(),
        Some(d) => pythonize::depythonize(d).map_err(|e| match PyErr::from(e) {
            e if e.is_instance_of::<PyTypeError>(d.py()) => e,
            e => PyValueError::new_err(format!("tuning: {}", e.value(d.py()))),
        })?,
    };
    Tuning::new(&knobs).map_err(PyValueError::new_err)
}

/// The keywords of an engine call (`**options`, as `stcast._engine` and the folder code
/// pass them) read into the engine's `given::Settings`, and `tuning=`, made into the
/// engine's options by `make` (a `Settings` method): an absent or None keyword is the
/// default, an unknown one a TypeError.
macro_rules! options {
    ($($name:ident),* $(,)?) => {
        fn read_options<T>(
            py: Python<'_>,
            kwargs: Option<&Bound<'_, PyDict>>,
            make: impl FnOnce(&Settings, Tuning) -> Result<T>,
        ) -> PyResult<T> {
            let (mut s, mut knobs) = (Settings::default(), None);
            for (k, v) in kwargs.into_iter().flat_map(|d| d.iter()) {
                let given = !v.is_none();
                match k.extract::<String>()?.as_str() {
                    $(stringify!($name) if given => s.$name = v.extract()?,)*
                    "tuning" if given => knobs = Some(v.cast_into::<PyDict>()?),
                    $(stringify!($name))|* | "tuning" => {}
                    k => {
                        let msg = format!("unexpected keyword argument {k:?}");
                        return Err(PyTypeError::new_err(msg));
                    }
                }
            }
            make(&s, tuning(knobs.as_ref())?).map_err(|e| to_py(py, e))
        }
    };
}

options! {
    to, threads, force, keep, keep_min_size, keep_unmatched, strict, from_bf16, keep_names,
    on_overflow, scan, numerics, report, config, replaces, allow_copy, key, strip_prefix, loose,
    allow_quantized, quantization_config, packed_config, follow_links, unquantized, name,
    no_record, include, exclude, lone,
}

#[pyfunction]
#[pyo3(name = "convert", signature = (src, dst, *, progress=None, cancel=None, warn=None,
                                      sealed=None, **options))]
fn py_convert<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    progress: Hook<'py>,
    cancel: Hook<'py>,
    warn: Hook<'py>,
    sealed: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = read_options(py, options, Settings::convert)?;
    let hooks = Hooks::new(progress, cancel, warn, sealed);
    finish_convert(
        py,
        &hooks,
        &opts,
        || ConvertTask::new(&src, &dst, &opts),
        None,
    )
}

/// Make a conversion (`new`), step it to its end, seal, publish (`Hooks::publish`): a dict.
fn finish_convert<'py>(
    py: Python<'py>,
    hooks: &Hooks<'py>,
    opts: &ConvertOptions,
    new: impl FnOnce() -> Result<ConvertTask> + Send,
    rel: Option<&OsStr>,
) -> PyResult<Bound<'py, PyDict>> {
    // Dropping `task` on any early return removes the unpublished output.
    let mut task = hooks.run(py, new)?;
    hooks.drive(py, &mut task, opts.tuning.step)?;
    hooks.run(py, || task.seal())?;
    // A signal or cancel until here (or until `sealed` returns) leaves nothing behind.
    hooks.visit(py, &mut task)?;
    let r = hooks.publish(py, task, rel.map(|rel| (rel, Some("folder-sealed"))))?;
    let d = crossed(py, &r, &[("src", &r.src), ("dst", &r.dst)])?;
    let numerics = opts.numerics;
    let measured =
        numerics.then(|| numerics_dict(py, &r.numerics, &r.numerics_total, &r.dequantized));
    d.set_item("numerics", measured.transpose()?)?;
    Ok(d)
}

/// Option `name`'s value (one of a repeated option's) as `Given::check` checks it.
#[pyfunction]
fn check_option<'py>(py: Python<'py>, name: &str, value: Given) -> PyResult<Bound<'py, PyAny>> {
    let def = options::find(name).ok_or_else(|| PyValueError::new_err(format!("{name:?}?")))?;
    Ok(pythonize::pythonize(
        py,
        &value.check(def).map_err(|e| to_py(py, e))?,
    )?)
}

/// Refuses an option `given` (set) that does not apply to a run from `src`
/// (`given::check_applies`).
#[pyfunction]
fn check_applies(py: Python<'_>, src: PathBuf, given: Vec<String>) -> PyResult<()> {
    let given: Vec<_> = given
        .iter()
        .filter_map(|n| OptionName::from_name(n))
        .collect();
    guarded(py, || crate::given::check_applies(&src, &given))
}

/// A model config as a run writes it (`run::json::config_text`); None: copied as it is.
#[pyfunction]
#[pyo3(signature = (text, to, *, dequantize=false, shards=None))]
fn config_text(
    py: Python<'_>,
    text: &str,
    to: Given,
    dequantize: bool,
    shards: Option<Vec<PathBuf>>,
) -> PyResult<Option<Cow<'static, [u8]>>> {
    let to = to.target().map_err(|e| to_py(py, e))?;
    let modules = shards.map(|s| guarded(py, || fp8config::Modules::of_files(&s)));
    let ignore = modules.transpose()?.map(|m| m.unquantized);
    let out = json::config_text(text, to, dequantize, ignore.as_deref()).map_err(not_json)?;
    Ok(out.map(|s| s.into_bytes().into()))
}

/// An index as a run writes it (`run::json::index`).
#[pyfunction]
#[pyo3(signature = (text, *, total=0, weight_map=None, sort_keys=false, renames=None, record=None))]
fn index_text(
    text: Option<&str>,
    total: u64,
    weight_map: Option<Vec<(String, String)>>,
    sort_keys: bool,
    renames: Option<HashMap<String, String>>,
    record: Option<&str>,
) -> PyResult<Cow<'static, [u8]>> {
    let out = json::index(
        text,
        total,
        weight_map.as_deref(),
        sort_keys,
        renames.as_ref(),
        record,
    );
    Ok(out.map_err(not_json)?.into_bytes().into())
}

fn not_json(e: json::NotJson) -> PyErr {
    PyValueError::new_err(format!("not JSON (at byte {})", e.0))
}

/// The text of a JSON file of a run (a config, an index), bounded and checked
/// (`folder::read_json`).
#[pyfunction]
fn read_json(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    guarded(py, || crate::folder::read_json(&path))
}

/// The stem and numbers of a shard name `STEM-00001-of-00002` (`naming::split_shard_name`).
#[pyfunction]
fn split_shard_name(name: OsString) -> Option<(OsString, OsString, OsString)> {
    use std::os::unix::ffi::OsStrExt;
    let os = |b: &[u8]| std::ffi::OsStr::from_bytes(b).to_owned();
    let (stem, i, n) = crate::naming::split_shard(name.as_bytes())?;
    Some((os(stem), os(i), os(n)))
}

/// What `src` is (`run::place::source`): "file", "checkpoint", "tree", or None if not there.
#[pyfunction]
#[pyo3(signature = (src, *, check=true))]
fn source_kind(py: Python<'_>, src: PathBuf, check: bool) -> PyResult<Option<&'static str>> {
    guarded(py, || Ok(place::source(&src, check)?.name()))
}

/// Where a folder run reads and writes (`run::place::place`): the source read, the
/// destination (`dst`, or the default for `to`), the source's identity (checked).
#[pyfunction]
#[pyo3(signature = (src, dst, to=Target::Bf16, *, resharding, check=true))]
fn run_place(
    py: Python<'_>,
    src: PathBuf,
    dst: Option<PathBuf>,
    to: Target,
    resharding: bool,
    check: bool,
) -> PyResult<(OsString, OsString, place::Ident)> {
    let p = guarded(py, || {
        place::place(&src, dst.as_deref(), to, resharding, check)
    })?;
    Ok((p.src.into(), p.dst.into(), p.id))
}

/// The destination a run writes when none is given (`run::place::default_dst`), or, for a
/// one-file run given `dst`, the file it names (`run::place::file_dst`).
#[pyfunction]
#[pyo3(signature = (src, to, *, folder=false, dst=None))]
fn default_dst(
    py: Python<'_>,
    src: PathBuf,
    to: Target,
    folder: bool,
    dst: Option<PathBuf>,
) -> PyResult<OsString> {
    guarded(py, || match dst {
        Some(dst) => Ok(place::file_dst(&src, &dst, to)?.into()),
        None => Ok(place::default_dst(&src, to, folder)?.into()),
    })
}

/// What verify with `options` compares (`run::place::verify_route`): the output, and
/// whether a folder.
#[pyfunction]
#[pyo3(signature = (src, dst, **options))]
fn verify_route(
    py: Python<'_>,
    src: PathBuf,
    dst: PathBuf,
    options: Option<&Bound<'_, PyDict>>,
) -> PyResult<(OsString, bool)> {
    let given = read_options(py, options, |s, _| Ok(s.clone()))?;
    guarded(py, || {
        let to = given.to.as_ref().map(Given::target).transpose()?;
        let (dst, folder) = place::verify_route(&src, &dst, to, given.name.is_some())?;
        Ok((dst.into(), folder))
    })
}

/// Where `dst` would be written (`output::space`): (folder, free bytes, whether `need` fit).
#[pyfunction]
fn space(py: Python<'_>, dst: PathBuf, need: u64) -> PyResult<(OsString, u64, bool)> {
    guarded(py, || {
        let s = crate::output::space(&dst, need)?;
        Ok((s.folder.into(), s.free, s.fits))
    })
}

/// A folder run's plan of output units (`folder::work::Work`).
#[pyclass(frozen, module = "stcast._core")]
struct FolderWork(Work);

/// A unit: its rel, output bytes, tensor bytes read, input bytes it stands for, input
/// files, and whether it is a weight file converted whole.
type UnitRow<'a> = (&'a OsStr, u64, u64, u64, Vec<walk::FileRow>, bool);
/// An index checked (`Work::checked_indexes`), its content as bytes.
type IndexRow = (OsString, Cow<'static, [u8]>, Option<u64>, Option<OsString>);
type Dicts<'py> = Vec<Bound<'py, PyDict>>;

#[pymethods]
impl FolderWork {
    /// Plan the folder run of `src` (`folder::work::WorkTask`), stepped a weight file and a
    /// group at a time (`cancel` checked between them): with `max_shard_size`, re-sharded
    /// (`single`: `src` is one checkpoint).
    #[new]
    #[pyo3(signature = (src, *, check_quantized, single=false, max_shard_size=None,
                        shard_links=false, keep_names=None, unquantized=None, record=None,
                        cancel=None, **options))]
    fn new(
        py: Python<'_>,
        src: PathBuf,
        check_quantized: bool,
        single: bool,
        max_shard_size: Option<u64>,
        shard_links: bool,
        keep_names: Option<Vec<Vec<String>>>,
        unquantized: Option<Vec<Vec<String>>>,
        record: Option<&Bound<'_, PyDict>>,
        cancel: Hook<'_>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let (given, tuning) = read_options(py, options, |s, t| Ok((s.clone(), t)))?;
        // The options the outputs record, when not those planned with (`finalize`'s).
        let recorded = record.map(|r| read_options(py, Some(r), |s, _| Ok(s.clone())));
        let recorded = recorded.transpose()?;
        let cut = max_shard_size.map(|max_size| Cut {
            max_size,
            follow_links: shard_links,
            keep_names,
            unquantized,
        });
        let (hooks, step) = (Hooks::new(None, cancel, None, None), tuning.step);
        let new = || WorkTask::new(&src, &given, tuning, check_quantized, single, cut, recorded);
        let mut task = hooks.run(py, new)?;
        hooks.drive(py, &mut task, step)?;
        Ok(FolderWork(hooks.run(py, move || task.finish())?))
    }

    /// The folder's plan: its files as tuples under `files`, the rest as plain data.
    fn plan<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (files, data) = self.0.plan.rows();
        let d = pythonize::pythonize(py, &data)?.cast_into::<PyDict>()?;
        d.set_item("files", files)?;
        Ok(d)
    }

    /// Each unit as a row (`UnitRow`).
    fn units(&self) -> Vec<UnitRow<'_>> {
        let w = &self.0;
        let inputs = |u: &Unit| -> Vec<walk::FileRow> {
            let files = u.inputs.iter();
            files.map(|&k| w.plan.weights[k].clone().row()).collect()
        };
        (w.units.iter())
            .map(|u| {
                let files = inputs(u);
                (
                    u.rel.as_os_str(),
                    u.size,
                    u.data_bytes,
                    u.input_bytes,
                    files,
                    u.whole,
                )
            })
            .collect()
    }

    #[getter]
    fn max_shard_size(&self) -> Option<u64> {
        self.0.max_size
    }

    #[getter]
    fn noun(&self) -> &'static str {
        self.0.noun()
    }

    /// What the plan said: (kind, template, the source file it is about).
    fn warnings(&self) -> Vec<(&'static str, &str, Option<&OsStr>)> {
        let said = self.0.warnings.iter();
        said.map(|(w, at)| (w.kind.name(), w.text.as_str(), at.as_deref()))
            .collect()
    }

    /// Every file the run writes: (rel, kind, bytes).
    fn outputs(&self) -> Vec<(OsString, &'static str, u64)> {
        let out = self.0.outputs().into_iter();
        out.map(|(rel, kind, size)| (rel, kind.name(), size))
            .collect()
    }

    /// Refuse a plain run that would write a copy of the folder `src` (`Work::check`).
    fn check(&self, py: Python<'_>, src: PathBuf) -> PyResult<()> {
        guarded(py, || self.0.check(&src))
    }

    /// Each unit's shard run of `n` (`Work::assign_shards`).
    fn assign_shards(&self, n: usize) -> Vec<usize> {
        self.0.assign_shards(n)
    }

    /// The indexes the run writes: (rel, weight map).
    fn index_maps(&self) -> Vec<(&OsStr, publish::WeightMap)> {
        let maps = self.0.index_maps().into_iter();
        maps.map(|(rel, _, map)| (rel, map.iter().cloned().collect()))
            .collect()
    }

    /// The indexes to write, checked against the shards in `dst` (`Work::checked_indexes`).
    fn checked_indexes(&self, py: Python<'_>, dst: PathBuf) -> PyResult<Vec<IndexRow>> {
        let checked = guarded(py, || self.0.checked_indexes(&dst))?;
        let bytes = |t: String| Cow::Owned(t.into_bytes());
        let out = checked.into_iter();
        Ok(out
            .map(|(rel, t, size, from)| (rel, bytes(t), size, from))
            .collect())
    }

    /// The shards and indexes a re-sharding writes, as `inspect` reports them.
    fn infos<'py>(&self, py: Python<'py>) -> PyResult<(Dicts<'py>, Dicts<'py>)> {
        let w = &self.0;
        let index = |k: usize| w.groups[k].index.as_ref().map(|i| i.0.as_os_str());
        let shards = w.units.iter().map(|u| {
            let inputs = u.inputs.iter().map(|&k| w.plan.weights[k].source_rel());
            let d = PyDict::new(py);
            d.set_item("path", &u.rel)?;
            d.set_item("bytes", u.size)?;
            d.set_item("tensors", u.names.len())?;
            d.set_item("tensors_converted", u.tensors_converted)?;
            d.set_item("tensors_kept", u.tensors_kept)?;
            d.set_item("data_bytes", u.data_bytes)?;
            d.set_item("target_bytes", u.target_bytes)?;
            d.set_item("inputs", inputs.collect::<Vec<_>>())?;
            d.set_item("index", index(u.group))?;
            Ok(d)
        });
        let indexes = (0..w.groups.len()).filter_map(|k| Some((k, w.groups[k].index.as_ref()?)));
        let indexes = indexes.map(|(k, (rel, text, _))| {
            let mine = w.units.iter().filter(|u| u.group == k);
            let d = PyDict::new(py);
            d.set_item("path", rel)?;
            d.set_item("bytes", text.len())?;
            d.set_item(
                "total_size",
                mine.clone().map(|u| u.target_bytes).sum::<u64>(),
            )?;
            d.set_item("shards", mine.count())?;
            Ok(d)
        });
        Ok((
            shards.collect::<PyResult<_>>()?,
            indexes.collect::<PyResult<_>>()?,
        ))
    }

    /// Unit `i`'s manifest entry, written at `out` by a run with `options` (as one of
    /// `shards` shard runs).
    fn entry<'py>(
        &self,
        py: Python<'py>,
        i: usize,
        options: &Bound<'py, PyAny>,
        shards: Option<u64>,
        out: PathBuf,
    ) -> PyResult<Bound<'py, PyAny>> {
        let options = json_of(options)?;
        let e = guarded(py, || self.0.entry(i, &options, shards, &out))?;
        py_json(py, &e)
    }

    /// The entry of `entries` that shows `out` is unit `i` written with `options`, if one does.
    fn find_entry<'py>(
        &self,
        py: Python<'py>,
        i: usize,
        entries: Vec<Bound<'py, PyAny>>,
        options: &Bound<'py, PyAny>,
        out: PathBuf,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let options = json_of(options)?;
        let nodes = entries.iter().map(json_of).collect::<PyResult<Vec<_>>>()?;
        let found = guarded(py, || {
            let e = self.0.find_entry(i, &nodes, &options, &out)?;
            Ok(e.map(|e| nodes.iter().position(|n| std::ptr::eq(n, e)).unwrap_or(0)))
        })?;
        Ok(found.map(|k| entries[k].clone()))
    }

    /// What the config `rel` is written as in `dst` (`Work::config_text`; None: copied).
    fn config_text(
        &self,
        py: Python<'_>,
        dst: PathBuf,
        rel: OsString,
    ) -> PyResult<Option<Cow<'static, [u8]>>> {
        let text = guarded(py, || self.0.config_text(&dst, &rel))?;
        Ok(text.map(|t| Cow::Owned(t.into_bytes())))
    }

    /// Convert unit `i` as its file of the folder run `run` (`Work::task`): it replaces only
    /// what the run may, and is claimed in the run's manifest before it has a name.
    #[pyo3(signature = (i, run, *, progress=None, cancel=None, warn=None, **options))]
    fn convert<'py>(
        &self,
        py: Python<'py>,
        i: usize,
        run: &Bound<'py, FolderRun>,
        progress: Hook<'py>,
        cancel: Hook<'py>,
        warn: Hook<'py>,
        options: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        // The call's `threads` and `tuning`; the rest is the plan's.
        let (threads, tuning) = read_options(py, options, |s, t| Ok((s.threads.clone(), t)))?;
        let hooks = Hooks::new(progress, cancel, warn, None).writing(run, true);
        let w = &run.get().0;
        let rel = self.0.units[i].rel.clone();
        let replaces = writer(w).replace_for(&rel);
        let dst = hooks.run(py, || writer(w).out_path(&rel))?;
        let s = Settings {
            threads,
            ..self.0.settings(i)
        };
        let mut opts = s.shard_convert(tuning).map_err(|e| to_py(py, e))?;
        (opts.replaces, opts.force) = (replaces, replaces.is_some());
        let new = || self.0.task(i, &dst, &opts);
        finish_convert(py, &hooks, &opts, new, Some(&rel))
    }
}

/// The header of a safetensors file (`source::read_header`).
#[pyfunction]
fn read_header(py: Python<'_>, path: PathBuf) -> PyResult<crate::source::HeaderSummary> {
    guarded(py, || crate::source::read_header(&path))
}

/// An engine report as a dict (its serde form, once), with its paths as Python holds them
/// (any bytes: serde would refuse a path that is not UTF-8).
fn crossed<'py>(
    py: Python<'py>,
    value: &impl serde::Serialize,
    paths: &[(&str, &Path)],
) -> PyResult<Bound<'py, PyDict>> {
    let d = pythonize::pythonize(py, value)?.cast_into::<PyDict>()?;
    for (k, p) in paths {
        d.set_item(*k, p.as_os_str())?;
    }
    Ok(d)
}

/// `{"tensors": TensorNumerics, "total": {counts and errors}}`.
fn numerics_dict<'py>(
    py: Python<'py>,
    tensors: &[(String, Numerics)],
    total: &Numerics,
    dequantized: &[DequantizedTensor],
) -> PyResult<Bound<'py, PyDict>> {
    let rows = TensorNumerics {
        rows: tensors.to_vec(),
        total: total.clone(),
        dequantized: dequantized.to_vec(),
    };
    let d = PyDict::new(py);
    d.set_item("tensors", Bound::new(py, rows)?)?;
    d.set_item("total", pythonize::pythonize(py, total)?)?;
    Ok(d)
}

/// The per-tensor numeric reports of a run, each row a dict built when read (300,000 tensors
/// cost no 300,000 dicts unless used): `stcast.reports` makes the sequence of them.
#[pyclass(frozen, module = "stcast._core")]
struct TensorNumerics {
    rows: Vec<(String, Numerics)>,
    /// Their total (what a folder's numeric report adds up, `write_numeric_report`).
    total: Numerics,
    /// The run's dequantized weights, for that report too.
    dequantized: Vec<DequantizedTensor>,
}

#[pymethods]
impl TensorNumerics {
    fn __len__(&self) -> usize {
        self.rows.len()
    }

    /// Row `i` (`0 <= i < len`) as a dict: its name, then its counts and errors.
    fn row<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        let Some((name, numerics)) = self.rows.get(i) else {
            return Err(PyIndexError::new_err("index out of range"));
        };
        Ok(pythonize::pythonize(py, &NumericsRow { name, numerics })?)
    }
}

#[pyfunction]
#[pyo3(name = "inspect", signature = (path, *, dst=None, progress=None, row=None, **options))]
fn py_inspect<'py>(
    py: Python<'py>,
    path: PathBuf,
    dst: Option<PathBuf>,
    progress: Hook<'py>,
    row: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let inspect = |s: &Settings, t| Ok((s.inspect(t, dst.is_some())?, s.scan));
    let (opts, scan) = read_options(py, options, inspect)?;
    let mut task = guarded(py, || InspectTask::new(&path, scan, &opts, dst.as_deref()))?;
    Hooks::new(progress, None, None, None).drive(py, &mut task, opts.tuning.step)?;
    let found = guarded(py, move || task.finish())?;
    inspection(py, &found, &found.source.path, None, &row)
}

/// A folder's dry run (`folder::inspect::InspectFolderTask`), stepped a weight file at a
/// time: its totals, other files and warnings, and under `files` each file's inspection.
#[pyfunction]
#[pyo3(signature = (src, *, checked, resharding, progress=None, row=None, **options))]
fn inspect_folder<'py>(
    py: Python<'py>,
    src: PathBuf,
    checked: bool,
    resharding: bool,
    progress: Hook<'py>,
    row: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let (given, tuning) = read_options(py, options, |s, t| Ok((s.clone(), t)))?;
    let (hooks, step) = (Hooks::new(progress, None, None, None), tuning.step);
    let mut planning = hooks.run(py, || {
        Planning::new(&src, &given, tuning, given.scan, checked, resharding)
    })?;
    // (The progress told is the scan's: the planning tells none.)
    Hooks::new(None, None, None, None).drive(py, &mut planning, step)?;
    let mut task = hooks.run(py, move || InspectFolderTask::new(planning))?;
    hooks.drive(py, &mut task, step)?;
    let found = hooks.run(py, move || task.finish())?;
    let d = pythonize::pythonize(py, &found.rows)?.cast_into::<PyDict>()?;
    d.set_item("named", found.named)?;
    let files = found
        .files
        .iter()
        .map(|(rel, f)| inspection(py, f, Path::new(rel), Some(rel), &row));
    d.set_item("files", files.collect::<PyResult<Vec<_>>>()?)?;
    Ok(d)
}

/// An inspection as a dict, named `path`, its tensors made one by one, each given to `row`
/// (with its `file`, a folder's).
fn inspection<'py>(
    py: Python<'py>,
    found: &Inspection,
    path: &Path,
    file: Option<&OsString>,
    row: &Hook<'py>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut rows = found.rows();
    let tensors = std::mem::take(&mut rows.tensors);
    let d = crossed(py, &rows, &[("path", path)])?;
    let made = tensors.iter().map(|t| {
        let t = pythonize::pythonize(py, t)?;
        if let Some(file) = file {
            t.set_item("file", file)?;
        }
        row.as_ref().map_or(Ok(t.clone()), |f| f.call1((t,)))
    });
    d.set_item("tensors", made.collect::<PyResult<Vec<_>>>()?)?;
    Ok(d)
}

#[pyfunction]
#[pyo3(name = "verify", signature = (src, dst, *, progress=None, warn=None, **options))]
fn py_verify<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    progress: Hook<'py>,
    warn: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = read_options(py, options, Settings::verify)?;
    let verifier = guarded(py, || Verifier::open(&src, &dst, &opts))?;
    finish_verify(py, (progress, warn), verifier, &opts)
}

/// Step a verification to its end (telling `progress` and `warn`); its report as a dict.
fn finish_verify<'py>(
    py: Python<'py>,
    (progress, warn): (Hook<'py>, Hook<'py>),
    mut verifier: Verifier,
    opts: &VerifyOptions,
) -> PyResult<Bound<'py, PyDict>> {
    Hooks::new(progress, None, warn, None).drive(py, &mut verifier, opts.tuning.step)?;
    let r = guarded(py, move || verifier.finish())?;
    verify_dict(py, &r, opts)
}

/// A verification's report as a dict.
fn verify_dict<'py>(
    py: Python<'py>,
    r: &VerifyReport,
    opts: &VerifyOptions,
) -> PyResult<Bound<'py, PyDict>> {
    let d = crossed(py, r, &[("src", &r.src), ("dst", &r.dst)])?;
    d.set_item("ok", r.is_ok())?;
    // Only a verified pair has the numbers of a conversion.
    let measured = (opts.numerics && r.is_ok())
        .then(|| numerics_dict(py, &r.numerics, &r.numerics_total, &r.dequantized));
    d.set_item("numerics", measured.transpose()?)?;
    Ok(d)
}

/// How to publish over an existing name (`output::Replace`): None, "any", or (dev, ino).
fn replace_policy(v: Option<&Bound<'_, PyAny>>) -> PyResult<Replace> {
    match v.filter(|v| !v.is_none()) {
        None => Ok(Replace::No),
        Some(v) if v.extract::<String>().is_ok_and(|s| s == "any") => Ok(Replace::Any),
        Some(v) => {
            let msg = "replace must be None, \"any\" or (dev, ino)";
            let (dev, ino) = v.extract().map_err(|_| PyValueError::new_err(msg))?;
            Ok(Replace::Same { dev, ino })
        }
    }
}

/// Verify the folder `dst` against `src` (`folder::verify_folder::FolderVerify`), stepped: the
/// report as a dict, its mismatch with its `file`, each file's (rel, numerics) as `parts`.
#[pyfunction]
#[pyo3(signature = (src, dst, *, progress=None, warn=None, **options))]
fn verify_folder<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    progress: Hook<'py>,
    warn: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let (given, tuning) = read_options(py, options, |s, t| Ok((s.clone(), t)))?;
    let (hooks, step) = (Hooks::new(progress, None, warn, None), tuning.step);
    let mut task = hooks.run(py, || FolderVerify::new(&src, &dst, &given, tuning))?;
    hooks.drive(py, &mut task, step)?;
    let r = hooks.run(py, move || task.finish())?;
    let d = crossed(py, &r, &[("src", &r.src), ("dst", &r.dst)])?;
    let m = r
        .mismatch
        .as_ref()
        .map(|(rel, m)| crossed(py, m, &[("file", rel)]));
    d.set_item("mismatch", m.transpose()?)?;
    let mut parts = Vec::new();
    for (rel, v) in &r.parts {
        let measured = (given.numerics && v.is_ok())
            .then(|| numerics_dict(py, &v.numerics, &v.numerics_total, &v.dequantized));
        parts.push((rel.as_os_str(), measured.transpose()?));
    }
    d.set_item("parts", parts)?;
    d.set_item("ok", r.is_ok())?;
    Ok(d)
}

/// Write a folder's numeric report to `path` from each file's rows (`report::files_report`).
#[pyfunction]
#[pyo3(signature = (path, src, dst, to, parts, *, replace=None))]
fn write_numeric_report<'py>(
    py: Python<'py>,
    path: PathBuf,
    src: PathBuf,
    dst: PathBuf,
    to: Option<&str>,
    parts: Vec<(Option<String>, Bound<'py, TensorNumerics>)>,
    replace: Option<&Bound<'py, PyAny>>,
) -> PyResult<(u64, u64, u64)> {
    let parts: Vec<_> = parts
        .iter()
        .map(|(f, r)| {
            let r = r.get();
            (f.as_deref(), &r.rows[..], &r.total, &r.dequantized[..])
        })
        .collect();
    let target = to.and_then(Target::from_name);
    let bytes = crate::report::files_report(&src, &dst, target, &parts);
    let replace = replace_policy(replace)?;
    Ok(guarded(py, || output::write_file(&path, &bytes, replace, ""))?.into())
}

/// Check a side output's path before any work (`output::check_side_path`); its replace policy.
#[pyfunction]
#[pyo3(signature = (path, role, force, taken))]
fn check_side_output(
    py: Python<'_>,
    path: PathBuf,
    role: Side,
    force: bool,
    taken: Vec<(PathBuf, Taken)>,
) -> PyResult<Option<&'static str>> {
    let replace = guarded(py, || output::check_side_path(&path, role, force, &taken))?;
    Ok((!matches!(replace, Replace::No)).then_some("any"))
}

/// Render a message template, calling `option(name, value)` for each placeholder.
#[pyfunction]
fn render(template: &str, option: &Bound<'_, PyAny>) -> PyResult<String> {
    let mut failed = None;
    let out = text::render(template, |p| {
        let r = option.call1((p.option.name(), p.value));
        r.and_then(|r| r.extract()).unwrap_or_else(|e| {
            failed.get_or_insert(e);
            String::new()
        })
    });
    failed.map_or(Ok(out), Err)
}

/// Bytes in the one unit system of every message: decimal, three significant digits.
#[pyfunction]
fn format_bytes(n: u64) -> String {
    text::format_bytes(n)
}

/// Escape braces in data put into a template (bytes that are not UTF-8 shown as U+FFFD, as
/// the engine shows paths).
#[pyfunction]
fn escape(s: OsString) -> String {
    text::esc(&s.to_string_lossy()).into_owned()
}

/// The usage error for an option's value, as the engine words it (for checks made in Python).
#[pyfunction]
fn option_error<'py>(
    py: Python<'py>,
    option: &str,
    value: Given,
    expected: &str,
) -> PyResult<Py<pyo3::exceptions::PyBaseException>> {
    let option = OptionName::from_name(option)
        .ok_or_else(|| PyValueError::new_err(format!("unknown option {option:?}")))?;
    Ok(to_py(py, value.bad(option, expected)).into_value(py))
}

/// Hit a failpoint of the Python side (`failpoint` module): raises the injected error.
#[pyfunction]
fn failpoint(py: Python<'_>, name: &str) -> PyResult<()> {
    failpoint_hit(name).map_err(|e| to_py(py, e))
}

// --- manifests (`run::manifest`) ---

/// A JSON string as Python holds it (a lone surrogate included).
fn py_str<'py>(py: Python<'py>, s: &json::Str<'_>) -> PyResult<Bound<'py, PyAny>> {
    match s {
        json::Str::Text(t) => Ok(t.into_pyobject(py)?.into_any()),
        json::Str::Wide(w) => {
            let bytes: Vec<u8> = w.iter().flat_map(|p| p.to_le_bytes()).collect();
            let b = pyo3::types::PyBytes::new(py, &bytes);
            b.call_method1("decode", ("utf-32-le", "surrogatepass"))
        }
    }
}

/// A JSON value as Python's `json.loads` gives it (`run::json::Node`).
fn py_json<'py>(py: Python<'py>, n: &json::Node<'_>) -> PyResult<Bound<'py, PyAny>> {
    use json::Value;
    let builtins = py.import("builtins")?;
    match &n.value {
        Value::Literal("null") => Ok(py.None().into_bound(py)),
        Value::Literal(b @ ("true" | "false")) => Ok(pyo3::types::PyBool::new(py, *b == "true")
            .to_owned()
            .into_any()),
        Value::Literal(x) => builtins.getattr("float")?.call1((*x,)),
        Value::Number(x) if x.contains(['.', 'e', 'E']) => {
            builtins.getattr("float")?.call1((&**x,))
        }
        Value::Number(x) => builtins.getattr("int")?.call1((&**x,)),
        Value::Str(s) => py_str(py, s),
        Value::Array(items) => {
            let items: PyResult<Vec<_>> = items.iter().map(|v| py_json(py, v)).collect();
            Ok(pyo3::types::PyList::new(py, items?)?.into_any())
        }
        Value::Object(_) => {
            let d = PyDict::new(py);
            for (k, v) in n.dict().unwrap_or_default() {
                d.set_item(py_str(py, k)?, py_json(py, v)?)?;
            }
            Ok(d.into_any())
        }
    }
}

/// A Python value (None, bool, int, float, str, list, tuple, dict of str) as JSON.
fn json_of(v: &Bound<'_, PyAny>) -> PyResult<json::Node<'static>> {
    use json::{Str, Value};
    use pyo3::types::{PyBool, PyFloat, PyInt, PyString};
    let text = |s: &Bound<'_, PyString>| -> PyResult<Str<'static>> {
        match s.extract::<String>() {
            Ok(t) => Ok(Str::Text(t.into())),
            Err(_) => {
                let b = s.call_method1("encode", ("utf-32-le", "surrogatepass"))?;
                let b: Vec<u8> = b.extract()?;
                let points = b
                    .chunks(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                Ok(Str::Wide(points.collect()))
            }
        }
    };
    let value = if v.is_none() {
        Value::Literal("null")
    } else if let Ok(b) = v.cast::<PyBool>() {
        Value::Literal(if b.is_true() { "true" } else { "false" })
    } else if v.is_instance_of::<PyInt>() {
        Value::Number(v.str()?.to_string().into())
    } else if v.is_instance_of::<PyFloat>() {
        Value::Number(json::float_repr(v.extract()?).into())
    } else if let Ok(s) = v.cast::<PyString>() {
        Value::Str(text(s)?)
    } else if let Ok(d) = v.cast::<PyDict>() {
        let members = d
            .iter()
            .map(|(k, v)| Ok((text(k.cast::<PyString>()?)?, json_of(&v)?)));
        Value::Object(members.collect::<PyResult<_>>()?)
    } else {
        let items = v.try_iter()?.map(|x| json_of(&x?));
        Value::Array(items.collect::<PyResult<_>>()?)
    };
    Ok(json::Node {
        value,
        span: (0, 0),
    })
}

/// Files and their JSON entries as a dict of lists.
fn py_entries<'py>(
    py: Python<'py>,
    entries: &[(OsString, Vec<json::Node<'static>>)],
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (rel, list) in entries {
        let list: PyResult<Vec<_>> = list.iter().map(|e| py_json(py, e)).collect();
        d.set_item(rel, list?)?;
    }
    Ok(d)
}

/// Another run's manifest (`run::manifest::Manifest`), which a folder run removes once it
/// completes the folder (`FolderRun.remove_own`).
#[pyclass(frozen, module = "stcast._core")]
struct Manifest(manifest::Manifest);

/// A folder run's writing into its destination (`run::publish::Writer`): its manifest, what
/// it may replace, publishing, withdrawing and rolling back.
#[pyclass(frozen, module = "stcast._core")]
struct FolderRun(Mutex<publish::Writer>);

/// The writer, whoever held it last (a panic in the engine is told by `guarded`).
fn writer(w: &Mutex<publish::Writer>) -> std::sync::MutexGuard<'_, publish::Writer> {
    w.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn failpoint_hit(name: &str) -> Result<()> {
    crate::failpoint::hit(name).map_err(|e| Error::io(Path::new(name), "failpoint", e))
}

#[pymethods]
impl FolderRun {
    #[new]
    #[pyo3(signature = (src, src_id, dst, options, allow_quantized, shard, planned, *,
                        published=None, first_replace=None, finalize=false, force=false,
                        ours=vec![], found=vec![]))]
    fn new(
        src: PathBuf,
        src_id: place::Ident,
        dst: PathBuf,
        options: &Bound<'_, PyAny>,
        allow_quantized: Option<bool>,
        shard: Option<manifest::Shard>,
        planned: Vec<OsString>,
        published: Option<place::Ident>,
        first_replace: Option<place::Ident>,
        finalize: bool,
        force: bool,
        ours: Vec<(OsString, place::Ident)>,
        found: Vec<(OsString, place::Ident)>,
    ) -> PyResult<Self> {
        let (options, a) = (json_of(options)?, allow_quantized);
        let mut m = manifest::Manifest::new(&src, src_id, &dst, options, a, shard, planned);
        (m.published, m.first_replace, m.finalize) = (published, first_replace, finalize);
        let w = publish::Writer::new(m, ours, found, force);
        Ok(FolderRun(Mutex::new(w)))
    }

    /// Record `rel`, there now, as done (`extra`: what resume needs to trust it); with
    /// `ours`, as this run's to replace from now on. Returns the identity recorded.
    #[pyo3(signature = (rel, kind, extra=None, *, ours=false))]
    fn record(
        &self,
        py: Python<'_>,
        rel: OsString,
        kind: &str,
        extra: Option<&Bound<'_, PyAny>>,
        ours: bool,
    ) -> PyResult<(u64, u64, u64)> {
        let extra = extra.map(json_of).transpose()?;
        let w = &self.0;
        guarded(py, || {
            let mut w = writer(w);
            match ours {
                true => w.published(&rel, kind, None, extra.as_ref()),
                false => {
                    let id = w.record.identity(&rel)?;
                    w.record.record(&rel, kind, id, extra.as_ref());
                    Ok(id)
                }
            }
        })
    }

    /// Create each of `dirs` in DST (`publish::Writer::folder`).
    fn folders(&self, py: Python<'_>, dirs: Vec<OsString>) -> PyResult<()> {
        guarded(py, || writer(&self.0).folders(&dirs))
    }

    /// `publish::Writer::make_folders` for `rels`, then `begin`: `before`, what DST holds;
    /// `had_manifest`: a manifest is at this run's name.
    #[pyo3(signature = (rels, before, had_manifest, cancel=None))]
    fn begin(
        &self,
        py: Python<'_>,
        rels: Vec<OsString>,
        before: HashSet<OsString>,
        had_manifest: bool,
        cancel: Hook<'_>,
    ) -> PyResult<()> {
        Hooks::new(None, cancel, None, None).run(py, || {
            let mut w = writer(&self.0);
            w.make_folders(&rels)?;
            w.begin(before, had_manifest)
        })
    }

    /// `complete`: the run is done.
    #[pyo3(signature = (cancel=None, *, complete=false))]
    fn save(&self, py: Python<'_>, cancel: Hook<'_>, complete: bool) -> PyResult<()> {
        Hooks::new(None, cancel, None, None).run(py, || {
            let mut w = writer(&self.0);
            w.record.complete |= complete;
            w.record.save()
        })
    }

    fn check_still_ours(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || writer(&self.0).record.check_still_ours())
    }

    /// Write `data` as its file `rel` of `kind` (`publish::Writer::write`, in steps).
    #[pyo3(signature = (rel, kind, data, *, cancel=None))]
    fn write<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        rel: OsString,
        kind: &str,
        data: Vec<u8>,
        cancel: Hook<'py>,
    ) -> PyResult<()> {
        let hooks = Hooks::new(None, cancel, None, None).writing(slf, false);
        let w = &slf.get().0;
        let out = hooks.run(py, || writer(w).seal_text(&rel, &data))?;
        let done = hooks.publish(py, out, Some((&rel, None)))?;
        hooks.run(py, || {
            writer(w).published(&rel, kind, Some(done.into()), None)
        })?;
        Ok(())
    }

    /// Copy the regular file `src` as its file `rel` of `kind`, in bounded steps.
    #[pyo3(signature = (rel, kind, src, *, progress=None, cancel=None))]
    fn copy<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        rel: OsString,
        kind: &str,
        src: PathBuf,
        progress: Hook<'py>,
        cancel: Hook<'py>,
    ) -> PyResult<()> {
        let hooks = Hooks::new(progress, cancel, None, None).writing(slf, false);
        let w = &slf.get().0;
        let mut copy = hooks.run(py, || writer(w).start_copy(&rel, &src))?;
        hooks.drive(py, &mut copy, Tuning::default().step)?;
        let out = hooks.run(py, move || copy.seal())?;
        let done = hooks.publish(py, out, Some((&rel, None)))?;
        hooks.run(py, || {
            writer(w).published(&rel, kind, Some(done.into()), None)
        })?;
        Ok(())
    }

    /// `publish::Writer::unpublish`: `indexes` as (rel, weight map).
    #[pyo3(signature = (indexes, writes, configs=vec![]))]
    fn unpublish(
        &self,
        py: Python<'_>,
        indexes: Vec<(OsString, publish::WeightMap)>,
        writes: HashSet<OsString>,
        configs: Vec<OsString>,
    ) -> PyResult<()> {
        guarded(py, || {
            writer(&self.0).unpublish(&indexes, &writes, &configs)
        })
    }

    fn remove_stale(&self, py: Python<'_>, stale: Vec<(OsString, place::Ident)>) -> PyResult<()> {
        guarded(py, || writer(&self.0).remove_stale(&stale))
    }

    /// `publish::Writer::recheck`, withdrawing `cues` if it fails.
    #[pyo3(signature = (cues=vec![]))]
    fn recheck(&self, py: Python<'_>, cues: Vec<OsString>) -> PyResult<()> {
        guarded(py, || writer(&self.0).recheck(&cues))
    }

    fn remove_own(&self, py: Python<'_>, others: Vec<Bound<'_, Manifest>>) -> PyResult<()> {
        let others: Vec<_> = others.iter().map(|m| m.get().0.clone()).collect();
        guarded(py, || writer(&self.0).remove_own(&others))
    }
}

/// What a folder run writes into `dst` and whether it may (`run::survey::survey`): the
/// outputs of the plan `work`, which answers for them (`folder::work::Judged`); `mine`
/// (None: `finalize`) asks for the `Room` too. Returns `Answer`'s fields, flat.
#[pyfunction]
#[pyo3(name = "survey", signature = (dst, src_id, shard, options, work, *, force, resume, mine=None, src=PathBuf::new()))]
fn py_survey<'py>(
    py: Python<'py>,
    dst: PathBuf,
    src_id: place::Ident,
    shard: Option<manifest::Shard>,
    options: &Bound<'py, PyAny>,
    work: &Bound<'py, FolderWork>,
    force: bool,
    resume: bool,
    mine: Option<Vec<OsString>>,
    src: PathBuf,
) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
    let (options, work) = (json_of(options)?, &work.get().0);
    let planned = work.outputs().into_iter();
    let planned = planned.map(|(rel, kind, size)| survey::Planned { rel, kind, size });
    let renamed = work.groups.iter().filter_map(|g| g.renamed.clone());
    let q = survey::Question {
        asked: manifest::Asked {
            src_id,
            shard,
            options: &options,
            force,
            resume,
        },
        outputs: planned.collect(),
        room: mine.map(|mine| survey::Room {
            src,
            sources: work.plan.sources(),
            mine,
            inputs: work.plan.weights.iter().map(|f| f.path.clone()).collect(),
            renamed: renamed.collect(),
        }),
    };
    let mut judge = Judged {
        work,
        dst: &dst,
        options: &options,
    };
    let a = guarded(py, || survey::survey(&dst, &q, &mut judge))?;
    let s = a.manifests;
    let own = s.own.and_then(|m| m.published);
    let siblings: Vec<Manifest> = s.siblings.into_iter().map(Manifest).collect();
    let entries = py_entries(py, &s.entries)?;
    let (at, ours, found) = (s.at_own_name, s.ours, s.found);
    let rest = (
        a.adopted, entries, a.stale, found, a.skipped, a.need, a.withdraw,
    );
    (s.present, at, own, siblings, ours, rest).into_pyobject(py)
}

/// The finished manifests `finalize` completes (`run::manifest::finished`), the options
/// they agree on, each file's entries, and each shard run's manifest and shard count.
#[pyfunction]
fn finished_manifests<'py>(
    py: Python<'py>,
    dst: PathBuf,
    src_id: place::Ident,
) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
    let f = guarded(py, || manifest::finished(&dst, src_id))?;
    let counts: Vec<_> = f
        .manifests
        .iter()
        .filter_map(|m| Some((m.path(), m.shard?.1)))
        .collect();
    let manifests: Vec<Manifest> = f.manifests.into_iter().map(Manifest).collect();
    (
        manifests,
        py_json(py, &f.options)?,
        py_entries(py, &f.entries)?,
        counts,
    )
        .into_pyobject(py)
}

/// Add each `#[pyfunction]` to the module.
macro_rules! add_functions {
    ($m:ident: $($f:ident),* $(,)?) => {
        $($m.add_function(wrap_pyfunction!($f, $m)?)?;)*
    };
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", VERSION)?;
    m.add_class::<TensorNumerics>()?;
    let exports = pythonize::pythonize(m.py(), &Exports::default())?;
    for (name, value) in exports.cast_into::<PyDict>()?.iter() {
        m.add(name.cast_into::<pyo3::types::PyString>()?, value)?;
    }
    m.add_class::<FolderWork>()?;
    m.add_class::<Manifest>()?;
    m.add_class::<FolderRun>()?;
    add_functions! {
        m: _set_exceptions, py_convert, py_inspect, inspect_folder, py_verify, render, format_bytes, escape,
        option_error, check_option, check_applies, failpoint, write_numeric_report,
        check_side_output,
        source_kind, read_header, config_text, index_text,
        read_json, split_shard_name, run_place, default_dst, verify_route, space, py_survey,
        finished_manifests,
        verify_folder,
    }
    Ok(())
}
