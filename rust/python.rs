//! The PyO3 adapter: argument conversion, GIL release in bounded steps, error mapping.
//!
//! It holds no logic of its own: it converts arguments into engine options, makes one engine
//! task per command (`command`), has the engine's `task::drive::Driver` step it with the GIL
//! released, telling the call's callbacks (`Hooks`: signals, the cancel flag, progress,
//! warnings), and converts what the engine returns into plain Python data. Exceptions are the
//! classes `stcast.errors` hands over at import, one per `vocab::ErrorKind` (`to_py`).

#![allow(clippy::too_many_arguments, reason = "pyfunctions mirror Python calls")]

use std::ffi::{OsStr, OsString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use pyo3::exceptions::{PyIndexError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{IntoPyDict, PyDict};

use crate::command::{Convert, ConvertDone, Inspect, Inspected, Verified, Verify};
use crate::convert::{Knobs, Tuning};
use crate::error::{panic_message, Error, Warning};
use crate::folder::dry::Dry;
use crate::folder::finish::{FinalizeTask, FolderReport};
use crate::folder::work::Work;
use crate::given::{Exports, Given, Settings, ShardGiven};
use crate::numerics::Numerics;
use crate::options;
use crate::report::NumericsRow;
use crate::run::place;
use crate::task::drive::{Caller, Driver};
use crate::task::Inspection;
use crate::text;
use crate::verify::VerifyReport;
use crate::vocab::{ErrorKind, OptionName, Unmatched};
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
    driver(py, None, None, None, None).run(f)
}

/// A callback the caller may give (`progress`, `cancel`, `warn`, `file_progress`).
type Hook<'py> = Option<Bound<'py, PyAny>>;

/// The callbacks of a call, which the engine's `Driver` tells what a task says between
/// steps (`task::drive`: when, and each value once).
struct Hooks<'py> {
    py: Python<'py>,
    progress: Hook<'py>,
    cancel: Hook<'py>,
    warn: Hook<'py>,
    file_progress: Hook<'py>,
}

/// The engine's driver of a call's task, telling `Hooks`.
fn driver<'py>(
    py: Python<'py>,
    progress: Hook<'py>,
    cancel: Hook<'py>,
    warn: Hook<'py>,
    file_progress: Hook<'py>,
) -> Driver<Hooks<'py>> {
    Driver::new(Hooks {
        py,
        progress,
        cancel,
        warn,
        file_progress,
    })
}

impl Caller for Hooks<'_> {
    type Failure = PyErr;
    /// Ctrl-C (the signal handler's exception), then the cancel flag.
    fn stop(&mut self) -> PyResult<()> {
        self.py.check_signals()?;
        let cancel = self.cancel.as_ref().map(|c| c.call_method0("is_set"));
        match cancel.transpose()? {
            Some(set) if set.is_truthy()? => Err(to_py(self.py, Error::Cancelled)),
            _ => Ok(()),
        }
    }
    /// `warn(kind, template, path)`.
    fn warn(&mut self, w: &Warning, at: Option<&OsStr>) -> PyResult<()> {
        let told = self
            .warn
            .as_ref()
            .map(|f| f.call1((w.kind.name(), &w.text, at)));
        told.transpose().map(drop)
    }
    fn progress(&mut self, done: u64, total: u64) -> PyResult<()> {
        let told = self.progress.as_ref().map(|f| f.call1((done, total)));
        told.transpose().map(drop)
    }
    fn file_progress(&mut self, rel: &OsStr, done: u64, total: u64) -> PyResult<()> {
        let told = self
            .file_progress
            .as_ref()
            .map(|f| f.call1((rel, done, total)));
        told.transpose().map(drop)
    }
    /// `f` with the GIL released, a panic caught.
    fn away<T: Send>(&mut self, f: impl FnOnce() -> T + Send) -> std::result::Result<T, String> {
        let done = self.py.detach(|| catch_unwind(AssertUnwindSafe(f)));
        done.map_err(|panic| panic_message(&*panic))
    }
    fn failure(&mut self, e: Error) -> PyErr {
        to_py(self.py, e)
    }
    fn panicked(&mut self, message: String) -> PyErr {
        PyRuntimeError::new_err(message)
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

/// `keep_unmatched` (`vocab::Unmatched`, by name); another value is a ValueError with the
/// names.
impl FromPyObject<'_, '_> for Unmatched {
    type Error = PyErr;
    fn extract(v: Borrowed<'_, '_, PyAny>) -> PyResult<Unmatched> {
        let name = v.extract::<String>()?;
        let names = Unmatched::NAMES;
        let msg = || format!("keep_unmatched must be one of {names:?}");
        Unmatched::from_name(&name).ok_or_else(|| PyValueError::new_err(msg()))
    }
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

/// A keyword's value of a type the engine cannot take, worded as PyO3 words an argument's:
/// "argument 'force': 'str' object cannot be cast as 'bool'".
fn argument(py: Python<'_>, name: &str, e: PyErr) -> PyErr {
    if !e.is_instance_of::<PyTypeError>(py) {
        return e;
    }
    let named = PyTypeError::new_err(format!("argument '{name}': {}", e.value(py)));
    named.set_cause(py, e.cause(py));
    named
}

/// The keywords of a command (`**options`, as `stcast._api` passes the options given) read
/// into the engine's `given::Settings`, and `tuning=`: an absent or None keyword is the
/// default, an unknown one a TypeError.
macro_rules! options {
    ($($name:ident),* $(,)?) => {
        fn read_options(
            py: Python<'_>,
            kwargs: Option<&Bound<'_, PyDict>>,
        ) -> PyResult<(Settings, Tuning)> {
            let (mut s, mut knobs) = (Settings::default(), None);
            for (k, v) in kwargs.into_iter().flat_map(|d| d.iter()) {
                let given = !v.is_none();
                match k.extract::<String>()?.as_str() {
                    $(stringify!($name) if given => {
                        s.$name = v.extract().map_err(|e| argument(py, stringify!($name), e))?
                    })*
                    "tuning" if given => knobs = Some(v.cast_into::<PyDict>()?),
                    $(stringify!($name))|* | "tuning" => {}
                    k => {
                        let msg = format!("unexpected keyword argument {k:?}");
                        return Err(PyTypeError::new_err(msg));
                    }
                }
            }
            Ok((s, tuning(knobs.as_ref())?))
        }
    };
}

options! {
    to, threads, force, keep, keep_min_size, keep_unmatched, strict, from_bf16, on_overflow,
    scan, numerics, report, config, key, strip_prefix, loose, allow_quantized, follow_links,
    name, no_record, include, exclude, max_shard_size, shard, resume,
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

/// The stem and numbers of a shard name `STEM-00001-of-00002` (`naming::split_shard`).
#[pyfunction]
fn split_shard_name(name: OsString) -> Option<(OsString, OsString, OsString)> {
    use std::os::unix::ffi::OsStrExt;
    let os = |b: &[u8]| std::ffi::OsStr::from_bytes(b).to_owned();
    let (stem, i, n) = crate::naming::split_shard(name.as_bytes())?;
    Some((os(stem), os(i), os(n)))
}

/// What `src` is (`run::place::source`, unchecked): "file", "checkpoint", "tree", or None
/// if not there (the terminal's words for it).
#[pyfunction]
fn source_kind(py: Python<'_>, src: PathBuf) -> PyResult<Option<&'static str>> {
    guarded(py, || Ok(place::source(&src, false)?.name()))
}

/// The destination a run writes when none is given (`run::place::default_dst`), `to` checked
/// as the option is.
#[pyfunction]
#[pyo3(signature = (src, to, *, folder=false))]
fn default_dst(py: Python<'_>, src: PathBuf, to: Given, folder: bool) -> PyResult<OsString> {
    let to = to.target().map_err(|e| to_py(py, e))?;
    guarded(py, || Ok(place::default_dst(&src, to, folder)?.into()))
}

type Dicts<'py> = Vec<Bound<'py, PyDict>>;

/// The shards and indexes a re-sharding writes (`folder::work::Work`), as `inspect` reports
/// them.
fn plan_infos<'py>(py: Python<'py>, w: &Work) -> PyResult<(Dicts<'py>, Dicts<'py>)> {
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

/// `shard` as given, its numbers read as Python's `int` reads them.
impl FromPyObject<'_, '_> for ShardGiven {
    type Error = PyErr;
    fn extract(v: Borrowed<'_, '_, PyAny>) -> PyResult<ShardGiven> {
        let py = v.py();
        let repr = v.repr()?.to_string();
        let int = py.import("builtins")?.getattr("int")?;
        // (Three items are enough to refuse: an endless iterable is not read to its end.)
        let read = || -> PyResult<((i128, i128), String)> {
            let items = v.try_iter()?.take(3).collect::<PyResult<Vec<_>>>()?;
            let [i, n] = &items[..] else {
                return Err(PyValueError::new_err("not a pair"));
            };
            let (i, n) = (int.call1((i,))?, int.call1((n,))?);
            let held = |x: &Bound<'_, PyAny>| match x.extract::<i128>() {
                Ok(x) => Ok(x),
                Err(_) if x.gt(0)? => Ok(i128::MAX),
                Err(_) => Ok::<_, PyErr>(i128::MIN),
            };
            Ok(((held(&i)?, held(&n)?), format!("{}/{}", i.str()?, n.str()?)))
        };
        let (parts, numbers) = match read() {
            Ok((parts, numbers)) => (Some(parts), numbers),
            Err(e)
                if e.is_instance_of::<PyTypeError>(py) || e.is_instance_of::<PyValueError>(py) =>
            {
                (None, String::new())
            }
            Err(e) => return Err(e),
        };
        Ok(ShardGiven {
            parts,
            numbers,
            repr,
        })
    }
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
) -> PyResult<Bound<'py, PyDict>> {
    let rows = TensorNumerics {
        rows: tensors.to_vec(),
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

/// A `convert` (`command::Convert`: one file, or a folder run), stepped: every check, the
/// writing, and a folder run's numeric report; each warning told to `warn` as (kind,
/// template, path) as it is said. Its report, with `folder`; a folder run's numerics as each
/// unit's (file, numerics).
#[pyfunction]
#[pyo3(signature = (src, dst=None, *, progress=None, file_progress=None, cancel=None,
                    warn=None, **options))]
fn convert<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: Option<PathBuf>,
    progress: Hook<'py>,
    file_progress: Hook<'py>,
    cancel: Hook<'py>,
    warn: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let (given, tuning) = read_options(py, options)?;
    let step = tuning.step;
    let mut d = driver(py, progress, cancel, warn, file_progress);
    let mut task = d.run(|| Convert::new(&src, dst.as_deref(), &given, tuning))?;
    d.metered = matches!(task, Convert::Folder(_));
    d.drive(&mut task, step)?;
    let folder = matches!(task, Convert::Folder(_));
    let (d, parts) = match d.run(move || task.finish())? {
        ConvertDone::File { report, measured } => {
            let d = crossed(py, &report, &[("src", &report.src), ("dst", &report.dst)])?;
            let n = measured.then(|| numerics_dict(py, &report.numerics, &report.numerics_total));
            d.set_item("finalize", py.None())?; // (one file is complete once published)
            (d, n.transpose()?.into_pyobject(py)?)
        }
        ConvertDone::Folder(report, converted) => {
            let parts = converted.iter().map(|c| {
                let r = &c.report;
                let n = c
                    .measured
                    .then(|| numerics_dict(py, &r.numerics, &r.numerics_total));
                Ok((c.rel.clone(), n.transpose()?))
            });
            let parts = parts.collect::<PyResult<Vec<_>>>()?;
            (folder_report(py, &report)?, parts.into_pyobject(py)?)
        }
    };
    d.set_item("numerics", parts)?;
    d.set_item("folder", folder)?;
    Ok(d)
}

/// An `inspect` (`command::Inspect`: one file, or a folder's dry run), stepped: with `dst`,
/// after every check the `convert` it names makes, with where its output would go
/// (`destination`). Its tensors each made by `row`; a folder's totals, other files and
/// warnings, each file's inspection under `files`, and a re-sharding's plan (`plan_infos`).
#[pyfunction]
#[pyo3(signature = (src, dst=None, *, progress=None, row=None, **options))]
fn inspect<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: Option<PathBuf>,
    progress: Hook<'py>,
    row: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let (given, tuning) = read_options(py, options)?;
    let step = tuning.step;
    let mut d = driver(py, progress, None, None, None);
    let mut task = d.run(|| Inspect::new(&src, dst.as_deref(), &given, tuning))?;
    d.drive(&mut task, step)?;
    let folder = matches!(task, Inspect::Folder(..));
    let (d, at) = match d.run(move || task.finish())? {
        Inspected::File(found, at) => (inspection(py, &found, &found.source.path, None, &row)?, at),
        Inspected::Folder(dry, at) => {
            let Dry { src, found, work } = *dry;
            let d = pythonize::pythonize(py, &found.rows)?.cast_into::<PyDict>()?;
            d.set_item("path", src.as_os_str())?;
            d.set_item("named", found.named)?;
            let files = found
                .files
                .iter()
                .map(|(rel, f)| inspection(py, f, Path::new(rel), Some(rel), &row));
            d.set_item("files", files.collect::<PyResult<Vec<_>>>()?)?;
            if let Some(w) = work {
                let (shards, indexes) = plan_infos(py, &w)?;
                d.set_item("max_shard_size", w.max_size)?;
                d.set_item("shards", shards)?;
                d.set_item("indexes", indexes)?;
            }
            (d, at)
        }
    };
    let at = at.map(|a| crossed(py, &a, &[("path", &a.path), ("folder", &a.folder)]));
    d.set_item("destination", at.transpose()?)?;
    d.set_item("folder", folder)?;
    Ok(d)
}

/// A `verify` (`command::Verify`: one pair of files, or of folders), stepped: the report as a
/// dict, with `folder`; a folder's mismatch with its `file`, each file's (rel, numerics) as
/// `parts`.
#[pyfunction]
#[pyo3(signature = (src, dst, *, progress=None, warn=None, **options))]
fn verify<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    progress: Hook<'py>,
    warn: Hook<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let (given, tuning) = read_options(py, options)?;
    let step = tuning.step;
    let mut d = driver(py, progress, None, warn, None);
    let mut task = d.run(|| Verify::new(&src, &dst, &given, tuning))?;
    d.drive(&mut task, step)?;
    let measured = |ok: bool, r: &VerifyReport, numerics: bool| {
        let n = (numerics && ok).then(|| numerics_dict(py, &r.numerics, &r.numerics_total));
        n.transpose()
    };
    let folder = matches!(task, Verify::Folder(_));
    let d = match d.run(move || task.finish())? {
        Verified::File(r, numerics) => {
            let d = crossed(py, &*r, &[("src", &r.src), ("dst", &r.dst)])?;
            d.set_item("numerics", measured(r.is_ok(), &r, numerics)?)?;
            d.set_item("ok", r.is_ok())?;
            d
        }
        Verified::Folder(r) => {
            let d = crossed(py, &*r, &[("src", &r.src), ("dst", &r.dst)])?;
            let m = r.mismatch.as_ref();
            let m = m.map(|(rel, m)| crossed(py, m, &[("file", rel)]));
            d.set_item("mismatch", m.transpose()?)?;
            let parts = r
                .parts
                .iter()
                .map(|(rel, v)| Ok((rel.as_os_str(), measured(v.is_ok(), v, given.numerics)?)));
            d.set_item("parts", parts.collect::<PyResult<Vec<_>>>()?)?;
            d.set_item("ok", r.is_ok())?;
            d
        }
    };
    d.set_item("folder", folder)?;
    Ok(d)
}

/// Complete the folder `dst` once its shard runs are done (`folder::finish::FinalizeTask`),
/// stepped: its report (`folder_report`).
#[pyfunction]
#[pyo3(signature = (src, dst, *, progress=None, file_progress=None, cancel=None, warn=None))]
fn finalize<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    progress: Hook<'py>,
    file_progress: Hook<'py>,
    cancel: Hook<'py>,
    warn: Hook<'py>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut d = driver(py, progress, cancel, warn, file_progress);
    d.metered = true;
    let mut task = d.run(|| FinalizeTask::new(&src, &dst))?;
    d.drive(&mut task, Tuning::default().step)?;
    folder_report(py, &task.finish())
}

/// A folder run's report as a dict (`stcast.reports.folder_report` builds it): its files
/// as dicts, warnings as (kind, template, path).
fn folder_report<'py>(py: Python<'py>, r: &FolderReport) -> PyResult<Bound<'py, PyDict>> {
    type Said<'a> = Vec<(&'static str, &'a str, Option<&'a OsStr>)>;
    fn said(w: &[(Warning, Option<OsString>)]) -> Said<'_> {
        let said = w.iter();
        said.map(|(w, at)| (w.kind.name(), w.text.as_str(), at.as_deref()))
            .collect()
    }
    let d = crossed(py, r, &[("src", &r.src), ("dst", &r.dst)])?;
    d.set_item("warnings", said(&r.warnings))?;
    let finalize = r.finalize.as_ref();
    d.set_item(
        "finalize",
        finalize.map(|(s, d)| (s.as_os_str(), d.as_os_str())),
    )?;
    let files = r.files.iter().map(|f| {
        let row = crossed(py, f, &[("path", Path::new(&f.path))])?;
        row.set_item("warnings", said(&f.warnings))?;
        row.set_item("source", f.source.as_deref())?;
        Ok(row)
    });
    d.set_item("files", files.collect::<PyResult<Vec<_>>>()?)?;
    // (The units' numerics rows are their conversions': `convert` gives them; a run that
    // converts none has none.)
    d.set_item("numerics", py.None())?;
    Ok(d)
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
    add_functions! {
        m: _set_exceptions, convert, inspect, verify, finalize, render, format_bytes,
        check_option, source_kind, split_shard_name, default_dst,
    }
    Ok(())
}
