"""benchmarks/restart.py's table: each scenario's median phases side by side."""

from __future__ import annotations

import statistics

from restart_runner import LAUNCHED, SCENARIOS

PHASES = ("interpreter_s", "imports_s", "cuda_context_s", "plugins_s", "skeleton_s", "load_s", "first_token_s")


def parameter_count(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.0f} M"


def median_of(runs: list[dict]) -> dict:
    keys = {k for run in runs for k, v in run.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {k: statistics.median(run[k] for run in runs if isinstance(run.get(k), (int, float))) for k in sorted(keys)}


def table(result: dict) -> str:
    """Each phase's median per scenario, the totals, then what only some scenarios have; a head line of the model and runs."""
    s = result["scenarios"]
    columns = [name for name in SCENARIOS if name in s]
    attach_total = s.get("attach", {}).get("median", {}).get("total_s")

    def cell(name, key):
        value = s[name]["median"].get(key)
        if name == "warm-spare" and key in PHASES[:-1]:
            return "(before)"
        return "—" if value is None else f"{value:.2f}"

    rows = [("phase (s, median)", *columns)]
    labels = {
        "interpreter_s": "interpreter start (launched: launch command + fork)",
        "imports_s": "imports (torch, transformers, model; CUDA set-up overlapped)",
        "cuda_context_s": "CUDA context (left after the imports)",
        "plugins_s": "weightcache's adapters (entry points)",
        "skeleton_s": "model skeleton (meta)",
        "load_s": "map + rebind / disk load",
        "first_token_s": "first token (one forward)",
    }
    for key in PHASES:
        rows.append((labels[key], *(cell(name, key) for name in columns)))
    rows.append(
        (
            "total: exec -> first token",
            *(
                f"{s[n]['median']['total_s']:.2f}" if n != "warm-spare" else f"{s[n]['median']['total_s']:.2f} (kill -> token)"
                for n in columns
            ),
        )
    )
    if attach_total:
        rows.append(("vs attach", *(f"{s[n]['median']['total_s'] / attach_total:.2f}x" for n in columns)))
    rows += _more_rows(result, columns)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    m = result["model"]
    head = (
        f"restart to first token: Qwen3 {result['size']} ({parameter_count(m['parameters'])} parameters, {m['bytes'] / 1e9:.2f} GB bf16), "
        f"{result['machine']['device']}, median of {result['runs']} run(s); publish once: {result['publish_s']:.1f} s"
    )
    return "\n".join([head, *lines])


def _more_rows(result: dict, columns: list[str]) -> list[tuple[str, ...]]:
    """The rows only some scenarios fill: weightcache's own share, the warm spare's, the tokenizer, the evicted batch
    engine, the launcher's start, the page cache before a cold run."""
    s = result["scenarios"]
    rows: list[tuple[str, ...]] = []
    if "attach" in s:
        ours = s["attach"]["median"]["ours_s"]
        skeleton = s["attach"]["median"]["skeleton_s"]
        rows.append(
            (
                "weightcache's own share (adapters + load_model, framework imported)",
                *(f"{ours:.3f} (skeleton {skeleton:.3f})" if n == "attach" else "" for n in columns),
            )
        )
    if "warm-spare" in s:
        spare = s["warm-spare"]["median"]
        for label, text in (
            (
                "warm spare: kill -> trigger / trigger -> token",
                f"{spare['trigger_s'] * 1000:.1f} / {spare['first_token_s'] * 1000:.1f} ms",
            ),
            ("warm spare: ready after its start (paid before)", f"{spare['ready_after_spawn_s']:.2f}"),
            ("warm spare: private memory grown by attach + warm-up", f"{spare['private_growth_bytes'] / 2**20:.1f} MiB"),
        ):
            rows.append((label, *(text if n == "warm-spare" else "" for n in columns)))
    if "tokenizer_s" in s.get(columns[0], {}).get("median", {}):
        rows.append(
            (
                "tokenizer (AutoTokenizer.from_pretrained, outside the total)",
                *(f"{s[n]['median']['tokenizer_s']:.2f}" if "tokenizer_s" in s[n]["median"] else "" for n in columns),
            )
        )
    if "evicted-batch" in s:
        rows.append(
            (
                "evicted batch: kill -> back at its first token / online engine still running",
                *(
                    f"{s[n]['median']['kill_to_back_s']:.2f} / {all(r['online_still_running'] for r in s[n]['runs'])}"
                    if n == "evicted-batch"
                    else ""
                    for n in columns
                ),
            )
        )
    if result.get("launcher_ready"):
        ready = result["launcher_ready"]

        def launcher_of(name: str) -> dict | None:
            return ready.get("cuda-ready" if name == "launcher-cuda" else "plain") if name in LAUNCHED else None

        rows.append(
            (
                "launcher: ready after its start (paid before, once)",
                *(f"{launcher_of(n)['ready_after_spawn_s']:.2f}" if launcher_of(n) else "" for n in columns),
            )
        )
    if "disk-cold" in s:
        rows.append(
            (
                "page cache resident before the run",
                *(f"{s[n]['resident_before']:.0%}" if "resident_before" in s[n] else "" for n in columns),
            )
        )
    return rows
