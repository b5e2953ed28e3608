//! The PyO3 adapter: argument conversion, GIL release in bounded steps, error mapping.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use pyo3::exceptions::{PyException, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::convert::{self, Job, Options, Report, Source};
use crate::error::Error;
use crate::header::{self, Action, Plan, PlanOptions, Reason, Target, Unmatched};
use crate::kernels::Isa;
use crate::numerics::Numerics;
use crate::scan::{self, OnOverflow, Scan, ScanKind, Scanned};
use crate::verify::{Verifier, VerifyOptions, VerifyReport};
use crate::VERSION;

pyo3::create_exception!(
    stcast,
    StcastError,
    PyValueError,
    "Bad input or a refused operation. `kind` and `path` say which and where."
);
pyo3::create_exception!(
    stcast,
    Cancelled,
    PyException,
    "The conversion was cancelled through its `cancel` object; nothing was left behind."
);

/// Source bytes converted between two visits to Python (signals, progress, cancel).
/// At the rates we reach, that is well under a second.
const STEP_BYTES: u64 = 64 << 20;

fn to_py(py: Python<'_>, e: Error) -> PyErr {
    // A Ctrl-C that arrived while the step failed wins: the user asked to stop.
    if let Err(interrupt) = py.check_signals() {
        return interrupt;
    }
    match e {
        Error::Io { path, what, source } => match source.raw_os_error() {
            Some(errno) => {
                let text = source.to_string();
                let text = text.split(" (os error").next().unwrap_or(&text);
                // OSError(errno, ...) instantiates the matching subclass
                // (FileNotFoundError, PermissionError, ...).
                PyOSError::new_err((errno, format!("{what}: {text}"), path.into_os_string()))
            }
            None => PyOSError::new_err(format!("{}: {what}: {source}", path.display())),
        },
        Error::Cancelled => Cancelled::new_err("conversion cancelled"),
        other => {
            let err = StcastError::new_err(other.to_string());
            let value = err.value(py);
            let _ = value.setattr("kind", other.kind());
            let _ = value.setattr("path", other.path().map(|p| p.as_os_str()));
            err
        }
    }
}

/// Run engine work without the GIL; a panic becomes a one-line Python error.
fn guarded<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    match py.detach(|| catch_unwind(AssertUnwindSafe(f))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(py, e)),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(PyRuntimeError::new_err(format!(
                "internal error (please report it): {msg}"
            )))
        }
    }
}

fn parse_target(to: &str) -> PyResult<Target> {
    Target::parse(to).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown target {to:?}: expected \"bf16\" or \"fp16\""
        ))
    })
}

fn parse_unmatched(s: &str) -> PyResult<Unmatched> {
    match s {
        "warn" => Ok(Unmatched::Warn),
        "error" => Ok(Unmatched::Error),
        "ignore" => Ok(Unmatched::Ignore),
        _ => Err(PyValueError::new_err(format!(
            "keep_unmatched must be \"warn\", \"error\" or \"ignore\", not {s:?}"
        ))),
    }
}

fn parse_on_overflow(s: &str) -> PyResult<OnOverflow> {
    OnOverflow::parse(s).ok_or_else(|| {
        PyValueError::new_err(format!(
            "on_overflow must be \"warn\", \"error\" or \"keep\", not {s:?}"
        ))
    })
}

/// Between two steps: Ctrl-C, the cancel flag, then progress (which may raise).
fn visit(
    py: Python<'_>,
    cancel: &Option<Bound<'_, PyAny>>,
    progress: &Option<Bound<'_, PyAny>>,
    (done, total): (u64, u64),
) -> PyResult<()> {
    py.check_signals()?;
    if let Some(c) = cancel {
        if c.call_method0("is_set")?.is_truthy()? {
            return Err(Cancelled::new_err("conversion cancelled"));
        }
    }
    if let Some(p) = progress {
        p.call1((done, total))?;
    }
    Ok(())
}

/// Run a scan to its end in GIL-free steps; progress totals count `extra` more bytes (the
/// conversion that follows).
fn run_scan(
    py: Python<'_>,
    scan: &mut Scan,
    cancel: &Option<Bound<'_, PyAny>>,
    progress: &Option<Bound<'_, PyAny>>,
    extra: u64,
) -> PyResult<()> {
    loop {
        let finished = guarded(py, || scan.step(STEP_BYTES))?;
        let (done, total) = scan.progress();
        visit(py, cancel, progress, (done, total + extra))?;
        if finished {
            return Ok(());
        }
    }
}

/// The window in bytes for `window_mib=` (None: the default).
fn window_bytes(window_mib: Option<usize>) -> usize {
    window_mib.map_or(convert::DEFAULT_WINDOW, |m| m.max(1) << 20)
}

/// Worker threads asked for (None: one per core); a runaway number is refused, not spawned.
fn thread_count(threads: Option<usize>) -> PyResult<usize> {
    const MAX_THREADS: usize = 1024;
    match threads {
        Some(n) if n > MAX_THREADS => Err(PyValueError::new_err(format!(
            "threads={n} is more than {MAX_THREADS}"
        ))),
        t => Ok(t.unwrap_or(0)),
    }
}

/// A kernel family by name, for tests and benchmarks that must pin one.
fn parse_isa(name: &str) -> PyResult<Isa> {
    Isa::available()
        .into_iter()
        .find(|i| i.name() == name)
        .ok_or_else(|| {
            let names: Vec<_> = Isa::available().iter().map(|i| i.name()).collect();
            PyValueError::new_err(format!("isa {name:?} is not available here: {names:?}"))
        })
}

#[pyfunction]
#[pyo3(name = "convert", signature = (src, dst, *, to="bf16", threads=None, force=false, progress=None,
                    cancel=None, warn=None, window_mib=None, isa=None, keep=Vec::new(),
                    keep_min_size=0, keep_unmatched="warn", from_bf16=false,
                    on_overflow="warn", numerics=true))]
#[allow(clippy::too_many_arguments)]
fn py_convert<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    to: &str,
    threads: Option<usize>,
    force: bool,
    progress: Option<Bound<'py, PyAny>>,
    cancel: Option<Bound<'py, PyAny>>,
    warn: Option<Bound<'py, PyAny>>,
    window_mib: Option<usize>,
    isa: Option<&str>,
    keep: Vec<String>,
    keep_min_size: u64,
    keep_unmatched: &str,
    from_bf16: bool,
    on_overflow: &str,
    numerics: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = Options {
        target: parse_target(to)?,
        threads: thread_count(threads)?,
        force,
        window: window_bytes(window_mib),
        isa: isa.map(parse_isa).transpose()?,
        keep,
        keep_min_size,
        unmatched: parse_unmatched(keep_unmatched)?,
        from_bf16,
        on_overflow: parse_on_overflow(on_overflow)?,
        numerics,
        ..Options::default()
    };
    // Progress counts the scan's extra read (if any) before the conversion.
    let mut scanned = 0u64;
    let mut job = if opts.on_overflow == OnOverflow::Keep {
        let mut scan = guarded(py, || scan::overflow_scan(&src, &dst, &opts))?;
        scanned = scan.progress().1;
        let data = scan.source().data_len();
        visit(py, &cancel, &progress, (0, scanned + data))?;
        run_scan(py, &mut scan, &cancel, &progress, data)?;
        guarded(py, || scan::keep_job(scan, &dst, &opts))?
    } else {
        guarded(py, || Job::open(&src, &dst, &opts))?
    };
    let planned_warnings = job.plan().warnings.len();
    if let Some(w) = &warn {
        for msg in &job.plan().warnings {
            w.call1((msg,))?;
        }
    }
    if let Some(p) = &progress {
        let (done, total) = job.progress();
        p.call1((done + scanned, total + scanned))?;
    }
    // Dropping `job` on any early return below removes the unpublished output.
    loop {
        let finished = guarded(py, || job.step(STEP_BYTES))?;
        let (done, total) = job.progress();
        visit(py, &cancel, &progress, (done + scanned, total + scanned))?;
        if finished {
            break;
        }
    }
    let report = guarded(py, move || job.finish())?;
    // Warnings found while converting (overflow) come after the plan's.
    if let Some(w) = &warn {
        for msg in report.warnings.iter().skip(planned_warnings) {
            w.call1((msg,))?;
        }
    }
    let d = report_dict(py, &report)?;
    d.set_item("on_overflow", opts.on_overflow.name())?;
    let measured = if numerics {
        Some(numerics_dict(py, &report.numerics, &report.numerics_total)?)
    } else {
        None
    };
    d.set_item("numerics", measured)?;
    Ok(d)
}

/// `{"tensors": [{"name", counts and errors}], "total": {counts and errors}}`.
fn numerics_dict<'py>(
    py: Python<'py>,
    tensors: &[(String, Numerics)],
    total: &Numerics,
) -> PyResult<Bound<'py, PyDict>> {
    let list = PyList::empty(py);
    for (name, n) in tensors {
        list.append(numerics_fields(py, Some(name), n)?)?;
    }
    let d = PyDict::new(py);
    d.set_item("tensors", list)?;
    d.set_item("total", numerics_fields(py, None, total)?)?;
    Ok(d)
}

fn report_dict<'py>(py: Python<'py>, r: &Report) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("src", r.src.as_os_str())?;
    d.set_item("dst", r.dst.as_os_str())?;
    d.set_item("to", r.target.name())?;
    d.set_item("tensors_converted", r.tensors_converted)?;
    d.set_item("tensors_copied", r.tensors_copied)?;
    d.set_item("bytes_in", r.bytes_in)?;
    d.set_item("bytes_out", r.bytes_out)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("threads", r.threads)?;
    d.set_item("isa", r.isa.name())?;
    d.set_item("warnings", PyList::new(py, &r.warnings)?)?;
    d.set_item("tensors_kept", r.tensors_kept)?;
    d.set_item("bytes_kept", r.bytes_kept)?;
    let kept = PyList::empty(py);
    for k in &r.kept {
        let e = PyDict::new(py);
        e.set_item("name", &k.name)?;
        e.set_item("dtype", k.dtype.to_string())?;
        e.set_item("bytes", k.bytes)?;
        e.set_item("reason", k.reason.code())?;
        e.set_item("pattern", reason_pattern(&k.reason))?;
        kept.append(e)?;
    }
    d.set_item("kept", kept)?;
    Ok(d)
}

fn reason_pattern(r: &Reason) -> Option<&str> {
    match r {
        Reason::KeptByPattern(p) => Some(p),
        _ => None,
    }
}

#[pyfunction]
#[pyo3(name = "inspect", signature = (path, to="bf16", *, keep=Vec::new(), keep_min_size=0,
                    keep_unmatched="warn", from_bf16=false, scan=false, on_overflow="warn",
                    threads=None, progress=None, window_mib=None))]
#[allow(clippy::too_many_arguments)]
fn py_inspect<'py>(
    py: Python<'py>,
    path: PathBuf,
    to: &str,
    keep: Vec<String>,
    keep_min_size: u64,
    keep_unmatched: &str,
    from_bf16: bool,
    scan: bool,
    on_overflow: &str,
    threads: Option<usize>,
    progress: Option<Bound<'py, PyAny>>,
    window_mib: Option<usize>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut popts = PlanOptions {
        keep,
        keep_min_size,
        from_bf16,
        unmatched: parse_unmatched(keep_unmatched)?,
        ..PlanOptions::new(parse_target(to)?)
    };
    let on_overflow = parse_on_overflow(on_overflow)?;
    let (src, plan) = guarded(py, || convert::inspect(&path, &popts))?;
    // Keeping what would overflow needs the data: it implies the scan.
    if !scan && on_overflow != OnOverflow::Keep {
        return inspect_dict(py, &src, &plan, None);
    }
    let opts = Options {
        threads: thread_count(threads)?,
        window: window_bytes(window_mib),
        ..Options::default()
    };
    let mut job = guarded(py, || Scan::new(src, &plan, ScanKind::Numerics, &opts))?;
    visit(py, &None, &progress, job.progress())?;
    run_scan(py, &mut job, &None, &progress, 0)?;
    let (src, scanned) = job.finish();
    let plan = if on_overflow == OnOverflow::Keep {
        popts.keep_names = scan::overflowing(&scanned);
        guarded(py, || header::plan(&path, &src.header, &popts))?
    } else {
        plan
    };
    inspect_dict(py, &src, &plan, Some(&scanned))
}

fn inspect_dict<'py>(
    py: Python<'py>,
    src: &Source,
    plan: &Plan,
    scanned: Option<&[Scanned]>,
) -> PyResult<Bound<'py, PyDict>> {
    let h = &src.header;
    let d = PyDict::new(py);
    d.set_item("path", src.path.as_os_str())?;
    d.set_item("header_bytes", h.header_len)?;
    d.set_item("data_bytes", h.data_len())?;
    d.set_item("file_bytes", src.map.len())?;
    match &h.metadata {
        Some(meta) => {
            let m = PyDict::new(py);
            for (k, v) in meta {
                m.set_item(k, v)?;
            }
            d.set_item("metadata", m)?;
        }
        None => d.set_item("metadata", py.None())?,
    }
    // The plan is in output order; report tensors in input order with their fate.
    let mut fate = vec![None; h.tensors.len()];
    for t in &plan.tensors {
        fate[t.source] = Some(t);
    }
    let mut measured = vec![None; h.tensors.len()];
    for t in scanned.unwrap_or_default() {
        measured[t.source] = t.numerics.as_ref();
    }
    let tensors = PyList::empty(py);
    for (i, (t, planned)) in h.tensors.iter().zip(fate).enumerate() {
        let planned = planned.expect("every source tensor is planned");
        let e = PyDict::new(py);
        e.set_item("name", &t.name)?;
        e.set_item("dtype", t.dtype.to_string())?;
        e.set_item("shape", &t.shape)?;
        e.set_item("bytes", t.len())?;
        e.set_item("data_offsets", [t.start, t.end])?;
        e.set_item("target_dtype", planned.dtype.to_string())?;
        e.set_item("target_bytes", planned.end - planned.start)?;
        let action = match planned.action {
            Action::Copy => "copy",
            Action::Convert(_) => "convert",
        };
        e.set_item("action", action)?;
        e.set_item("target_offsets", [planned.start, planned.end])?;
        e.set_item("reason", plan.reasons[i].code())?;
        e.set_item("pattern", reason_pattern(&plan.reasons[i]))?;
        match measured[i] {
            Some(n) => e.set_item("numerics", numerics_fields(py, None, n)?)?,
            None => e.set_item("numerics", py.None())?,
        }
        tensors.append(e)?;
    }
    d.set_item("tensors", tensors)?;
    d.set_item("output_bytes", plan.file_len())?;
    d.set_item("to", plan.target.name())?;
    d.set_item("warnings", PyList::new(py, &plan.warnings)?)?;
    d.set_item("tensors_converted", plan.converted())?;
    d.set_item("tensors_copied", plan.tensors.len() - plan.converted())?;
    d.set_item("tensors_kept", plan.kept())?;
    d.set_item("bytes_kept", plan.kept_bytes())?;
    d.set_item("keep_unmatched", PyList::new(py, &plan.keep_unmatched)?)?;
    d.set_item("scanned", scanned.is_some())?;
    Ok(d)
}

/// One `Numerics` as a dict of its counts and errors, with the tensor name when given.
fn numerics_fields<'py>(
    py: Python<'py>,
    name: Option<&str>,
    n: &Numerics,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    if let Some(name) = name {
        d.set_item("name", name)?;
    }
    d.set_item("elements", n.elements)?;
    d.set_item("overflow", n.overflow)?;
    d.set_item("underflow_to_zero", n.underflow_to_zero)?;
    d.set_item("subnormal", n.subnormal)?;
    d.set_item("nan_in", n.nan_in)?;
    d.set_item("inf_in", n.inf_in)?;
    d.set_item("max_abs_error", n.max_abs_error)?;
    d.set_item("max_rel_error", n.max_rel_error)?;
    Ok(d)
}

#[pyfunction]
#[pyo3(name = "verify", signature = (src, dst, *, loose=false, threads=None, progress=None,
                    window_mib=None, numerics=true))]
#[allow(clippy::too_many_arguments)]
fn py_verify<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    loose: bool,
    threads: Option<usize>,
    progress: Option<Bound<'py, PyAny>>,
    window_mib: Option<usize>,
    numerics: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = VerifyOptions {
        loose,
        threads: thread_count(threads)?,
        window: window_bytes(window_mib),
        numerics,
    };
    let mut verifier = guarded(py, || Verifier::open(&src, &dst, &opts))?;
    if let Some(p) = &progress {
        p.call1(verifier.progress())?;
    }
    loop {
        let finished = guarded(py, || verifier.step(STEP_BYTES))?;
        visit(py, &None, &progress, verifier.progress())?;
        if finished {
            break;
        }
    }
    let report = verifier.finish();
    let d = verify_dict(py, &report)?;
    d.set_item("to", report.to.map(|t| t.name()))?;
    // Only a verified pair has the numbers of a conversion.
    let measured = if numerics && report.is_ok() {
        Some(numerics_dict(py, &report.numerics, &report.numerics_total)?)
    } else {
        None
    };
    d.set_item("numerics", measured)?;
    Ok(d)
}

fn verify_dict<'py>(py: Python<'py>, r: &VerifyReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("src", r.src.as_os_str())?;
    d.set_item("dst", r.dst.as_os_str())?;
    d.set_item("ok", r.is_ok())?;
    d.set_item("loose", r.loose)?;
    d.set_item("tensors_converted", r.tensors_converted)?;
    d.set_item("tensors_identical", r.tensors_identical)?;
    d.set_item("bytes_compared", r.bytes_compared)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("threads", r.threads)?;
    d.set_item("isa", r.isa.name())?;
    match &r.mismatch {
        None => d.set_item("mismatch", py.None())?,
        Some(m) => {
            let e = PyDict::new(py);
            e.set_item("message", &m.message)?;
            e.set_item("tensor", &m.tensor)?;
            e.set_item("index", m.index)?;
            e.set_item("source_bits", &m.source_bits)?;
            e.set_item("source_value", m.source_value)?;
            e.set_item("expected_bits", &m.expected_bits)?;
            e.set_item("found_bits", &m.found_bits)?;
            d.set_item("mismatch", e)?;
        }
    }
    Ok(d)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", VERSION)?;
    m.add("StcastError", py.get_type::<StcastError>())?;
    m.add("Cancelled", py.get_type::<Cancelled>())?;
    m.add_function(wrap_pyfunction!(py_convert, m)?)?;
    m.add_function(wrap_pyfunction!(py_inspect, m)?)?;
    m.add_function(wrap_pyfunction!(py_verify, m)?)?;
    Ok(())
}
