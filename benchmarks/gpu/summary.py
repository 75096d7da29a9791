"""Markdown tables of the GPU suite's reports: ``summary.md`` of a run, and the sections of
``docs/gpu-benchmarks.md`` (``collect.py``). Every table is headed by the device it ran on.

A report is the JSON a stage wrote, with the suite's ``suite`` record added (status, seconds,
budget, error); a stage that wrote none is its record and the rows it printed
(``partial_rows``). Reports written before the suite existed (no ``suite``) render the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["device_of", "render", "slug"]

_PARTIAL_ROWS = 40  # rows of a failed stage shown
_MESSAGE_CHARS = 200


def slug(device: str) -> str:
    """A device name as file names carry it: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return "-".join(device.lower().replace("(", " ").replace(")", " ").split())


def device_of(reports: dict[str, dict]) -> str:
    """The device of a run: the env report's, else the first report naming one."""
    for report in [reports.get("env", {}), *reports.values()]:
        if report.get("device"):
            return str(report["device"])
    return "unknown device"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        value = f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ").strip()


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def _columns(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """``rows`` as a table of ``(key, title)`` columns, leaving out columns no row has."""
    kept = [(key, title) for key, title in columns if any(key in row for row in rows)]
    return _table([title for _, title in kept], [[row.get(key) for key, _ in kept] for row in rows])


def _short(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:_MESSAGE_CHARS]


def _status(reports: dict[str, dict]) -> str:
    rows = []
    for name, report in reports.items():
        suite = report.get("suite", {})
        rows.append(
            [
                name,
                suite.get("status", "recorded"),
                suite.get("seconds"),
                suite.get("budget_s"),
                _short(suite.get("error", "")),
            ]
        )
    return _table(["stage", "status", "seconds", "budget s", "error"], rows)


def _env(report: dict) -> str:
    rows = [
        [name, package.get("version", ""), _short(package.get("error", ""))]
        for name, package in report.get("packages", {}).items()
    ]
    facts = ", ".join(
        f"{key} {report[key]}"
        for key in ("python", "torch", "cuda", "capability", "memory_gib", "cpus", "commit", "date")
        if report.get(key) is not None
    )
    return facts + "\n\n" + _table(["package", "version", "error"], rows)


def _jit(report: dict) -> str:
    tests = report.get("tests", [])
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(report.get("counts", {}).items()))
    text = f"`{report.get('command', '')}`: {counts or 'no test finished'}"
    bad = [t for t in tests if t["outcome"] in ("failed", "error")]
    if bad:
        rows = [[t["test"], t["outcome"], t["seconds"], _short(t.get("message", ""))] for t in bad]
        text += "\n\n" + _table(["test", "outcome", "s", "message"], rows)
    slowest = sorted(tests, key=lambda t: -t["seconds"])[:8]
    if slowest:
        rows = [[t["test"], t["outcome"], t["seconds"]] for t in slowest]
        text += "\n\nSlowest:\n\n" + _table(["test", "outcome", "s"], rows)
    return text


def _kernels(report: dict) -> str:
    columns = [
        ("op", "op"),
        ("shape", "shape"),
        ("mode", "mode"),
        ("impl", "impl"),
        ("median_ms", "ms"),
        ("gbps", "GB/s"),
        ("pct_of_copy", "% of copy"),
        ("tflops", "TFLOP/s"),
        ("peak_memory_bytes", "peak bytes"),
        ("error", "error"),
    ]
    rows = [
        row | {"error": _short(row["error"])} if "error" in row else row
        for row in report.get("results", [])
    ]
    text = f"copy bandwidth {report.get('copy_gbps')} GB/s, {report.get('config', {}).get('dtype')}"
    text += "\n\n" + _columns(rows, columns)
    checks = report.get("checks", [])
    if checks:
        rows = [[c["check"], c["value"], "PASS" if c["ok"] else "FAIL"] for c in checks]
        text += "\n\n" + _table(["target", "value", ""], rows)
    return text


def _mfu(report: dict) -> str:
    config, peak = report.get("config", {}), report.get("peak_flops")
    text = (
        f"preset {config.get('preset')}, {config.get('n_layers')} blocks, "
        f"{config.get('params')} params, {report.get('dtype')}; MFU against "
        + (f"a dense bf16 peak of {peak / 1e12:g} TFLOP/s" if peak else "no known peak")
    )
    columns = [
        ("variant", "variant"),
        ("batch", "batch"),
        ("seq", "seq"),
        ("step_ms_median", "step ms"),
        ("step_ms_stdev", "± ms"),
        ("tokens_per_s", "tokens/s"),
        ("tflop_per_s", "TFLOP/s"),
        ("mfu", "MFU"),
        ("peak_memory_gib", "peak GiB"),
        ("error", "error"),
    ]
    return text + "\n\n" + _columns(report.get("rows", []), columns)


def _moe(report: dict) -> str:
    sections = {
        "layer": [
            ("shape", "shape"),
            ("variant", "variant"),
            ("tokens", "tokens"),
            ("median_ms", "ms"),
            ("tokens_per_s", "tokens/s"),
            ("expert_tflop_per_s", "expert TFLOP/s"),
            ("time_vs_d9d", "time / d9d"),
        ],
        "grouped_gemm": [
            ("shape", "shape"),
            ("mode", "mode"),
            ("backend", "backend"),
            ("tokens", "tokens"),
            ("median_ms", "ms"),
            ("tflop_per_s", "TFLOP/s"),
            ("time_vs_torch", "time / torch"),
        ],
        "permute": [
            ("shape", "shape"),
            ("op", "op"),
            ("backend", "backend"),
            ("tokens", "tokens"),
            ("median_ms", "ms"),
            ("gb_per_s", "GB/s"),
            ("copy_gb_per_s", "copy GB/s"),
            ("fraction_of_copy", "of copy"),
        ],
    }
    tokens = {k: v for k, v in report.get("tokens", {}).items() if k != "why"}
    parts = [f"{report.get('dtype')}, tokens {tokens}"]
    for section, columns in sections.items():
        if report.get(section):
            parts.append(f"{section}:\n\n" + _columns(report[section], columns))
        if report.get(f"{section}_error"):
            parts.append(f"{section} failed: {_short(report[f'{section}_error'])}")
    return "\n\n".join(parts)


def _profile(report: dict) -> str:
    config = report.get("config", {})
    text = f"config {config}, {report.get('steps')} steps of {report.get('step_ms')} ms"
    line = report.get("timeline")
    if line:
        text += (
            f"; GPU span {line['span_ms']} ms, busy {line['busy_ms']} ms, idle {line['idle_ms']}"
            f" ms ({100 * line['idle_share']:.1f}%) in {line['gaps']} gaps"
        )
    if report.get("traces_in_window"):
        text += f"; WARNING: {report['traces_in_window']} Dynamo traces inside the profile"
    if report.get("host_syncs") is not None:
        text += "; host syncs " + ", ".join(f"{k} {v}" for k, v in report["host_syncs"].items())
    top = report.get("top", [])
    rows = [[r["name"], r["calls"], r["total_ms"], f"{100 * r['share']:.1f}%"] for r in top]
    text += f"\n\nTop by {report.get('top_by')}:\n\n" + _table(
        ["name", "calls", "ms", "share"], rows
    )
    if line and line["longest_gaps"]:
        rows = [[g["us"], g["after"], g["before"]] for g in line["longest_gaps"]]
        text += "\n\nLongest GPU idle gaps:\n\n" + _table(["µs", "after", "before"], rows)
    return text


def _host_state(report: dict) -> str:
    config = report.get("config", {})
    rows = []
    for name, r in report["results"].items():
        memory = r["memory_bytes"]
        rows.append(
            [
                name,
                r["median_step_ms"],
                r.get("ratio_to_device", 1.0),
                round(memory["opt_state_on_device"] / 2**30, 3),
                round(memory["opt_state_on_host"] / 2**30, 3),
                r.get("copied_gb_per_s_of_step", ""),
            ]
        )
    header = [
        "state on",
        "median step ms",
        "ratio",
        "state GiB device",
        "state GiB host",
        "GB/s copied",
    ]
    return (
        f"AdamW update of {config.get('params')} {config.get('dtype')} params "
        f"({config.get('preset')}); max |param difference| "
        f"{report.get('max_abs_param_difference')}\n\n" + _table(header, rows)
    )


def _fp8(report: dict) -> str:
    rows = report.get("rows", [])
    linear = [
        ("shape", "M x K x N"),
        ("recipe", "recipe"),
        ("mode", "mode"),
        ("median_ms", "ms"),
        ("min_ms", "min ms"),
        ("max_ms", "max ms"),
        ("tflop_per_s", "TFLOP/s"),
        ("speedup", "speedup"),
        ("output_sqnr_db", "out dB"),
        ("input_grad_sqnr_db", "dx dB"),
        ("weight_grad_sqnr_db", "dw dB"),
        ("error", "error"),
    ]
    e2e = [
        ("recipe", "recipe"),
        ("preset", "preset"),
        ("layers", "blocks"),
        ("batch", "batch"),
        ("seq", "seq"),
        ("step_ms_median", "step ms"),
        ("step_ms_min", "min ms"),
        ("step_ms_max", "max ms"),
        ("tokens_per_s", "tokens/s"),
        ("ratio_to_bf16", "ratio"),
        ("peak_memory_gib", "peak GiB"),
        ("error", "error"),
    ]
    parts = [
        f"speedup: the {report.get('baseline')} linear's median over each row's; ratio: tokens/s "
        f"over {report.get('dtype')}'s; dB: SQNR of the output and grads against float32"
    ]
    for part, columns in (("linear", linear), ("e2e", e2e)):
        shown = [
            row | {"error": _short(row["error"])} if "error" in row else row
            for row in rows
            if row.get("part") == part
        ]
        if shown:
            parts.append(f"{part}:\n\n" + _columns(shown, columns))
    return "\n\n".join(parts)


def _partial(report: dict) -> str:
    rows = report.get("partial_rows", [])
    if not rows:
        return "No result rows were printed before it stopped."
    keys = list(dict.fromkeys(key for row in rows for key in row))
    shown = _columns(rows[:_PARTIAL_ROWS], [(key, key) for key in keys])
    return f"{len(rows)} rows printed before it stopped:\n\n{shown}"


_SECTIONS: dict[str, Callable[[dict], str]] = {
    "env": _env,
    "jit": _jit,
    "kernels": _kernels,
    "mfu": _mfu,
    "moe": _moe,
    "profile": _profile,
    "fp8": _fp8,
    "host_state": _host_state,
}


def render(reports: dict[str, dict], *, heading: str = "#") -> str:
    """Markdown of ``{stage name: report}``: the stages' status, then a section per stage.

    Example:
        >>> print(render({"env": {"device": "cpu", "packages": {}}}).splitlines()[0])
        # GPU suite on cpu
    """
    device = device_of(reports)
    parts = [f"{heading} GPU suite on {device}", _status(reports)]
    for name, report in reports.items():
        where = report.get("device") or device
        parts.append(f"{heading}# {name} — {where}")
        source = [f"{key} {report[key]}" for key in ("torch", "commit", "date") if report.get(key)]
        if source and name != "env":
            parts.append(", ".join(source))
        suite = report.get("suite", {})
        if suite.get("status") == "not run":
            parts.append(suite["error"])
        elif "partial_rows" in report:
            parts.append(_partial(report))
        elif name in _SECTIONS:
            try:
                parts.append(_SECTIONS[name](report))
            except (KeyError, TypeError, ValueError) as error:  # a malformed report stays visible
                parts.append(f"Report not readable as a {name} report ({error!r}).")
        if suite.get("command"):
            parts.append(f"Command: `{suite['command']}`")
    return "\n\n".join(parts) + "\n"
