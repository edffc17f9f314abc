"""benchmarks/cold.py's record and table: each method's median and verification, the Markdown table, the issue's targets."""

from __future__ import annotations

import datetime
import json
import statistics

from cold_checkpoint import restart_name
from cold_child import REFERENCE_RELOADED, REFERENCE_SHARED
from cold_methods import METHODS, Method
from cold_parent import Parent, cache_cell


def summarize(method: Method, runs: list[dict]) -> dict:
    """The median of a method's runs, whether every run's bytes matched, its notes and page-cache state."""
    ran = [r for r in runs if r.get("status") == "ran"]
    summary = {"label": method.label, "runs": runs}
    version = next((r["version"] for r in runs if r.get("version")), None)
    if version:
        summary["label"] = f"{method.label} {version}"
    if not ran or len(ran) != len(runs):
        bad = next(r for r in runs if r.get("status") != "ran")
        summary["status"] = bad.get("status", "error")
        summary["reason"] = bad.get("reason") or bad.get("error") or "?"
        return summary
    summary["status"] = "ran"
    summary["seconds"] = statistics.median(r["seconds"] for r in ran)
    summary["verified"] = all(r.get("verify", {}).get("ok") for r in ran)
    summary["cache"] = ran[0].get("cache")
    caches = {cache_cell(r.get("cache")) for r in ran}
    summary["cache_cell"] = " / ".join(sorted(caches))
    notes = list(dict.fromkeys(n for r in ran for n in r.get("notes", [])))
    references = {r.get("verify", {}).get("reference") for r in ran} - {None, REFERENCE_SHARED, REFERENCE_RELOADED}
    summary["notes"] = notes + sorted(references)
    return summary


def verified_cell(summary: dict) -> str:
    if summary["status"] != "ran":
        return "—"
    if summary["verified"]:
        return "yes"
    runs = [r.get("verify", {}) for r in summary["runs"]]
    counts = {k: max(len(v.get(k) or []) for v in runs) for k in ("differ", "missing", "wrong_device", "wrong_dtype_or_shape")}
    said = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items() if n)
    return f"NO ({said or next((v.get('error') for v in runs if v.get('error')), 'not checked')})"


def table(result: dict) -> str:
    """The rows as a Markdown table, then the verification failures and the issue's targets."""
    nbytes = result["checkpoint"]["bytes"]
    rows = [("method", "seconds", "GB/s", "verified", "cache", "notes")]
    for summary in result["methods"].values():
        if summary["status"] == "ran":
            seconds = summary["seconds"]
            rows.append(
                (
                    summary["label"],
                    f"{seconds:.2f}",
                    f"{nbytes / seconds / 1e9:.2f}",
                    verified_cell(summary),
                    summary["cache_cell"],
                    "; ".join(summary["notes"]),
                )
            )
        else:
            rows.append((summary["label"], "—", "—", "—", "", f"{summary['status']}: {summary['reason']}"))
    lines = ["| " + " | ".join(row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    c = result["checkpoint"]
    m = result["machine"]
    head = (
        f"cold load of {c['name']} ({c['bytes'] / 1e9:.2f} GB, {c['tensors']} tensors in {c['files']} files) to {m['device']}; "
        f"{m.get('gpu', 'no GPU')}, torch {m.get('torch')}, Python {m.get('python')}; {m['date']}; "
        f"median of {result['runs']} run(s), each row a fresh process, page cache dropped before each (column cache); "
        f"bytes checked against {result['reference']}"
    )
    out = [head, "", *lines]
    failures = [
        f"BYTES DIFFER: {s['label']}: {json.dumps({k: v for k, v in r['verify'].items() if v and k not in ('ok', 'tensors', 'bytes_checked', 'reference')})[:600]}"
        for s in result["methods"].values()
        for r in s["runs"]
        if r.get("status") == "ran" and not r.get("verify", {}).get("ok")
    ]
    out += ["", *failures] if failures else []
    out += ["", *result["targets"]] if result.get("targets") else []
    return "\n".join(out)


def targets(methods: dict) -> list[str]:
    """Issue 20's targets: first-sight and remembered publish no slower than the fastest peer; the CLI within +6 s of it."""
    peers = {
        name: s["seconds"]
        for name, s in methods.items()
        if s["status"] == "ran" and s.get("verified") and not name.startswith(("raw-", "wc-", "control-"))
    }
    if not peers:
        return []
    fastest = min(peers, key=peers.get)
    best = peers[fastest]
    lines = [f"fastest peer: {methods[fastest]['label']}, {best:.2f} s"]
    for name, limit, text in (
        ("wc-publish-first", best, "first-sight publish <= fastest peer"),
        ("wc-publish-remembered", best, "remembered publish <= fastest peer"),
        ("wc-cli", best + 6, "whole CLI (first sight) <= fastest peer + 6 s"),
        ("wc-cli-layout", best + 6, "whole CLI (first sight, layout remembered) <= fastest peer + 6 s"),
        ("wc-cli-remembered", best + 6, "whole CLI (digests remembered) <= fastest peer + 6 s"),
    ):
        s = methods.get(name)
        if s and s["status"] == "ran":
            verdict = "met" if s["seconds"] <= limit and s["verified"] else "MISSED"
            lines.append(f"target {text}: {s['seconds']:.2f} s vs {limit:.2f} s: {verdict}")
    return lines


def record_of(parent: Parent, results: dict[str, list[dict]], command: str, wall: float) -> dict:
    """The full record of the rows run so far: checkpoint, machine, each method's runs and summary, the targets."""
    methods = {}
    for key, runs in results.items():
        method = METHODS[key.split(" ")[0]]
        summary = summarize(method, runs)
        if key != method.name:
            summary["label"] += key[len(method.name) :]  # " (end of run)", or a reader variant's " [label]"
        methods[key] = summary
    return {
        "checkpoint": {
            "name": restart_name(parent.model),
            "path": str(parent.model),
            "bytes": parent.nbytes,
            "tensors": len(parent.entries),
            "files": len(parent.files),
        },
        "machine": {**parent.facts, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")},
        "runs": parent.args.runs,
        "command": command,
        "reference": REFERENCE_SHARED if parent.reference_file else REFERENCE_RELOADED,
        "methods": methods,
        "targets": targets(methods),
        "wall_s": round(wall, 1),
    }
