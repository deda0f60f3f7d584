"""``python -m ckpt``: list, verify, inspect, garbage-collect and export checkpoints.

Exit codes: 0 success; 1 verification failed (``verify``) or nothing committed
where something was required; 2 bad usage or an error reaching storage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ckpt.format.layout import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    QUARANTINE_MARKER_NAME,
    parse_checkpoint_dirname,
)
from ckpt.format.manifest import MAX_MANIFEST_BYTES, Manifest
from ckpt.loading.reader import ShardReader
from ckpt.loading.verify import (
    MODE_CHECKSUM,
    MODE_DEEP,
    MODE_FAST,
    VerifyReport,
    non_finite_tensors,
    verify_dir,
)
from ckpt.root import ownership
from ckpt.root.catalog import (
    DAMAGED,
    FOREIGN,
    PARTIAL,
    QUARANTINED,
    RENAMED,
    Catalog,
    CheckpointInfo,
    require_root,
    resolve,
)
from ckpt.root.lease import read_lease
from ckpt.root.quarantine import parse_quarantined_dirname, record_matches
from ckpt.root.quarantine import read_record as read_quarantine_record
from ckpt.root.retention import RetentionPolicy, apply_retention
from ckpt.storage import DIR, Storage
from runcore.redact import RedactingStream, redact

OBJECT_STORES = ("gs", "s3")
"""Schemes whose stores keep each object's crc32c (verify reads none of ours)."""
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def shown(text: object) -> str:
    """``text`` safe for a terminal: names and reasons come from the checkpoint root, which
    anyone with write access to it controls (control characters are escaped)."""
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
        for c in redact(str(text))
    )


def cmd_ls(args: argparse.Namespace) -> int:
    catalog = Catalog(require_root(args.url))  # one listing for checkpoints and quarantined ones
    infos = list(catalog)
    aside = catalog.quarantined()
    foreign = catalog.foreign()
    if args.json:
        rows = [
            {
                "step": i.step,
                "status": i.status,
                "url": i.url,
                "reason": i.reason,
                "bytes": i.manifest.total_bytes if i.manifest else None,
                "world_size": i.manifest.world_size if i.manifest else None,
                "created_at": i.manifest.created_at if i.manifest else None,
            }
            for i in infos
        ]
        rows += [
            {
                "step": q.step,
                "status": QUARANTINED,
                "url": q.url,
                "reason": q.reason,
                "path": q.path,
                "quarantined_at": q.quarantined_at,
            }
            for q in aside
        ]
        rows += [
            {"name": f.name, "status": FOREIGN, "url": f.url, "reason": f.reason} for f in foreign
        ]
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    lease = read_lease(catalog.storage)
    if lease is not None:
        now = time.time()
        state = "expired" if lease.expired(now) else "held"
        print(f"owner lease ({state}): {shown(lease.describe(now))}")
    if not infos and not aside and not foreign:
        print(f"no checkpoints under {args.url}")
        return EXIT_OK
    print(f"{'STEP':>10}  {'STATUS':<11}  {'SIZE':>10}  {'WORLD':>5}  {'CREATED':<24}  NOTE")
    for i in infos:
        size = human_bytes(i.manifest.total_bytes) if i.manifest else "-"
        world = str(i.manifest.world_size) if i.manifest else "-"
        created = i.manifest.created_at[:23] if i.manifest else "-"
        print(
            f"{i.step:>10}  {i.status:<11}  {size:>10}  {world:>5}  {shown(created):<24}  "
            f"{shown(i.reason)}"
        )
    for q in aside:
        print(
            f"{q.step:>10}  {QUARANTINED:<11}  {'-':>10}  {'-':>5}  "
            f"{shown(q.quarantined_at[:23]):<24}  {q.dirname}: {shown(q.reason)}"
        )
    for f in foreign:
        print(
            f"{'-':>10}  {FOREIGN:<11}  {'-':>10}  {'-':>5}  {'-':<24}  {shown(f.name)}: {f.reason}"
        )
    committed = sum(i.committed for i in infos)
    partial = sum(i.status == PARTIAL for i in infos)
    quarantined = len(aside) + sum(i.status == QUARANTINED for i in infos)
    others = len(foreign) + sum(i.status in (FOREIGN, RENAMED) for i in infos)
    damaged = sum(i.status == DAMAGED for i in infos)
    print(
        f"{committed} committed, {partial} partial, {quarantined} quarantined"
        + (f", {damaged} damaged (never loaded; a resume quarantines them)" if damaged else "")
        + (f", {others} foreign or renamed (left alone)" if others else "")
        + f", under {args.url}"
    )
    return EXIT_OK


def _verify_as_resume_would(ckpt_dir: Storage, manifest: Manifest, mode: str) -> VerifyReport:
    """``verify_dir``, then what a resume checks next: ``.metadata`` decodes with the
    safe loader (no code runs). OK means loadable."""
    report = verify_dir(ckpt_dir, manifest, mode=mode)
    if report.ok:
        try:
            ShardReader(ckpt_dir, manifest).fetch_metadata()
        except CheckpointError as exc:
            report.problems.append((DCP_METADATA_NAME, f"not loadable: {exc}"))
    return report


def _verify_quarantined(url: str, mode: str) -> int:
    """Forensics: check a quarantined directory's files against its own manifest.json."""
    parent, _, dirname = url.rpartition("/")
    ckpt_dir = Storage(url)
    reason = read_quarantine_record(Storage(parent or "."), dirname).get(
        "reason", "no QUARANTINED record"
    )
    try:
        if ckpt_dir.local_kind("") not in (None, DIR):
            raise CorruptCheckpointError(f"{url} is not a directory (a link is never followed)")
        manifest = Manifest.from_bytes(
            ckpt_dir.read_bytes(MANIFEST_NAME, max_bytes=MAX_MANIFEST_BYTES), url=url
        )
    except CheckpointError as exc:
        print(f"FAIL  {url} (quarantined: {shown(reason)}): manifest.json unreadable: {exc}")
        return EXIT_FAILED
    report = _verify_as_resume_would(ckpt_dir, manifest, mode)
    if not report.ok:
        print(f"FAIL  {url} (step {manifest.step}, {mode}; quarantined: {shown(reason)}):")
        for path, why in report.problems:
            print(f"      {shown(path)}: {shown(why)}")
        return EXIT_FAILED
    unchecked = f", {report.sizes_only} of them by size only" if report.sizes_only else ""
    print(
        f"OK    {url} (step {manifest.step}, {mode}: {report.files_checked} files verify now"
        f"{unchecked}; it was quarantined for: {shown(reason)})"
    )
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    mode = MODE_DEEP if args.deep else MODE_FAST if args.fast else MODE_CHECKSUM
    if parse_quarantined_dirname(args.url) is not None:
        return _verify_quarantined(args.url.rstrip("/"), mode)
    storage, info, damaged = _to_verify(args.url, args.step)
    for bad in damaged:
        print(f"FAIL  {bad.url} (step {bad.step}): {shown(bad.reason)}")
    if info is None:
        return EXIT_FAILED
    if not info.committed or info.manifest is None:
        print(f"FAIL  {info.url}: not committed ({info.status}): {shown(info.reason)}")
        return EXIT_FAILED
    code = _verify_committed(args, storage, info, mode)
    return EXIT_FAILED if damaged else code


def _to_verify(
    url: str, step: int | None
) -> tuple[Storage, CheckpointInfo | None, list[CheckpointInfo]]:
    """What ``verify`` checks: the checkpoint ``url`` (and ``step``) resolve to, and for a
    root without ``--step`` the damaged commits newer than its newest committed one.

    Those are what a resume tries first and quarantines; passing over them in silence
    would say OK for a root whose newest commit is lost.
    """
    if step is not None or parse_checkpoint_dirname(url.rstrip("/")) is not None:
        storage, info = resolve(url, step)
        return (storage, None, [info]) if info.status == DAMAGED else (storage, info, [])
    catalog = Catalog(require_root(url))
    damaged = []
    for info in catalog:
        if info.committed:
            return catalog.storage, catalog.info(info.step, chunks=True), damaged
        if info.status == DAMAGED:
            damaged.append(info)
    if not damaged:
        raise CheckpointNotFoundError(f"no committed checkpoint under {url}")
    return catalog.storage, None, damaged


def _verify_committed(
    args: argparse.Namespace, storage: Storage, info: CheckpointInfo, mode: str
) -> int:
    """Verify one committed checkpoint as ``cmd_verify`` reports it."""
    assert info.manifest is not None
    report = _verify_as_resume_would(storage.child(info.dirname), info.manifest, mode)
    if report.ok and args.finite:
        try:
            bad = non_finite_tensors(storage.child(info.dirname), info.manifest)
        except CheckpointError as exc:
            report.problems.append(("", f"values not readable: {exc}"))
        else:
            report.problems += [
                (key, f"{nans} NaN and {infs} infinite values") for key, (nans, infs) in bad.items()
            ]
    if not report.ok:
        print(f"FAIL  {info.url} (step {info.step}, {mode}{', finite' if args.finite else ''}):")
        for path, why in report.problems:
            print(f"      {shown(path)}: {shown(why)}")
        return EXIT_FAILED
    if report.sizes_only == 0:
        verdict = "OK   "
    elif report.sizes_only == report.files_checked:
        verdict = "OK (sizes only, contents not checked)"
    else:
        verdict = (
            f"OK (sizes only for {report.sizes_only} of {report.files_checked} files, "
            "their contents not checked)"
        )
    print(
        f"{verdict} {info.url} (step {info.step}, {mode}: {report.files_checked} files, "
        f"{human_bytes(info.manifest.total_bytes)}, {report.crc_checked} crc32c checked, "
        f"{human_bytes(report.bytes_checked)} read"
        f"{'; every floating tensor finite' if args.finite else ''})"
    )
    if report.read_in_full and storage.backend.scheme in OBJECT_STORES:
        listed = ", ".join(shown(p) for p in report.read_in_full[:5])
        more = " ..." if len(report.read_in_full) > 5 else ""
        print(
            f"      {len(report.read_in_full)} file(s) had no crc32c in the store (put there by "
            f"a client that sets none, e.g. a copy): read in full to check them: {listed}{more}"
        )
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    storage, info = resolve(args.url, args.step)
    if not info.committed or info.manifest is None:
        print(f"{info.url}: not committed ({info.status}): {shown(info.reason)}")
        return EXIT_FAILED
    m = info.manifest
    metadata = ShardReader(storage.child(info.dirname), m).fetch_metadata()
    tensors = []
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        size = getattr(md, "size", None)
        dtype = getattr(getattr(md, "properties", None), "dtype", None)
        tensors.append(
            (
                fqn,
                tuple(size) if size is not None else None,
                str(dtype).replace("torch.", "") if dtype else "bytes",
            )
        )
    if args.json:
        print(
            json.dumps(
                {
                    "url": info.url,
                    "step": m.step,
                    "world_size": m.world_size,
                    "created_at": m.created_at,
                    "run_id": m.attempt.run_id,
                    "restart_count": m.attempt.restart_count,
                    "torch_version": m.torch_version,
                    "bytes": m.total_bytes,
                    "membership": m.membership,
                    "files": [
                        {"path": f.path, "size": f.size, "crc32c": f.crc32c} for f in m.files
                    ],
                    "tensors": [{"name": n, "shape": s, "dtype": d} for n, s, d in tensors],
                    "metadata": m.metadata,
                },
                indent=1,
            )
        )
        return EXIT_OK
    print(f"checkpoint   {shown(info.url)}")
    print(f"step         {m.step}")
    print(f"created_at   {shown(m.created_at)}")
    hosts = sorted({shown(p.get("host")) if isinstance(p, dict) else "?" for p in m.membership})
    print(f"world_size   {m.world_size}  (hosts: {', '.join(hosts)})")
    print(f"attempt      run {shown(repr(m.attempt.run_id))}, restart {m.attempt.restart_count}")
    print(f"torch        {shown(m.torch_version)}")
    print(f"bytes        {human_bytes(m.total_bytes)} in {len(m.files)} files")
    print(
        f"tensors      {sum(1 for _, s, _ in tensors if s is not None)} tensors, "
        f"{sum(1 for _, s, _ in tensors if s is None)} other items"
    )
    for name, shape, dtype in tensors[: args.limit]:
        print(f"  {shown(name):<60} {dtype:<9} {list(shape) if shape is not None else ''}")
    if len(tensors) > args.limit:
        print(f"  ... {len(tensors) - args.limit} more (use --limit)")
    record = m.metadata.get("ckpt_manager", {})
    record = record if isinstance(record, dict) else {}
    positions = record.get("data_position")
    for key, pos in sorted((positions if isinstance(positions, dict) else {}).items()):
        if not isinstance(pos, dict):
            print(f"data         {shown(key)}: (malformed: {shown(repr(pos))[:80]})")
            continue
        print(
            f"data         {shown(key)}: cursor {shown(pos.get('cursor'))}, consumed digest "
            f"{shown(pos.get('consumed_digest') or '-')}, next batch "
            f"{shown(pos.get('next_batch_digest'))}"
        )
    per_rank = record.get("per_rank")
    if per_rank:
        listed = per_rank if isinstance(per_rank, list) else [f"(malformed: {per_rank!r})"]
        print(f"per rank     {shown(', '.join(str(p) for p in listed))}")
    if m.metadata:
        print("metadata     " + shown(json.dumps(m.metadata, sort_keys=True)[:500]))
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    catalog = Catalog(require_root(args.url))  # one listing, each manifest read once
    verb = "would delete" if args.dry_run else "deleted"
    if args.keep_last is None:
        return _gc_quarantined(catalog, args, verb)
    _gc_quarantined(catalog, args, verb)
    policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every)
    plan = apply_retention(catalog.storage, policy, dry_run=args.dry_run, catalog=catalog)
    for step in plan.keep:
        print(f"keep          step {step:>10}  ({plan.reasons.get(step, '')})")
    for step in (*plan.delete, *plan.delete_partial):
        if step in plan.refused:
            print(f"{'left alone':<13} step {step:>10}  ({shown(plan.refused[step])})")
        else:
            print(f"{verb:<13} step {step:>10}  ({plan.reasons.get(step, '')})")
    for step, kept_at in plan.set_aside.items():
        print(f"{'quarantined':<13} step {step:>10}  (renamed by hand; kept at {shown(kept_at)})")
    deleted = len(plan.delete) + len(plan.delete_partial) - len(plan.refused)
    print(
        f"{len(plan.keep)} kept, {deleted} {verb}"
        + (f", {len(plan.refused)} left alone (not provably ours)" if plan.refused else "")
        + (" (dry run: nothing was deleted)" if args.dry_run else "")
    )
    return EXIT_OK


def _gc_quarantined(catalog: Catalog, args: argparse.Namespace, verb: str) -> int:
    """Delete quarantined checkpoints (``--quarantined``), or say how many are kept.

    Only a directory whose QUARANTINED record names it (step and stamp) and whose files
    are all this library's is deleted (:mod:`ckpt.root.ownership`); others are said and kept.
    """
    storage = catalog.storage
    aside = [(q.dirname, q.step, q.reason) for q in catalog.quarantined()]
    aside += [(i.dirname, i.step, i.reason) for i in catalog if i.status == QUARANTINED]
    if not args.quarantined:
        if aside:
            print(
                f"kept          {len(aside)} quarantined checkpoint(s) (--quarantined deletes them)"
            )
        return EXIT_OK
    deleted = 0
    for dirname, step, reason in aside:
        why = _not_quarantined_by_us(storage, dirname)
        if why:
            print(f"{'left alone':<13} step {step:>10}  ({shown(dirname)}: {shown(why)})")
            continue
        if not args.dry_run:
            storage.remove_tree(dirname)
        deleted += 1
        print(f"{verb:<13} step {step:>10}  (quarantined {shown(dirname)}: {shown(reason)})")
    print(
        f"{deleted} quarantined {verb}"
        + (f", {len(aside) - deleted} left alone" if deleted < len(aside) else "")
        + (" (dry run: nothing was deleted)" if args.dry_run else "")
    )
    return EXIT_OK


def _in_place_of_own_step(storage: Storage, dirname: str) -> bool:
    """A quarantine interrupted before its move: still under its checkpoint name, with a
    QUARANTINED record, and a manifest of the step that name says."""
    step = parse_checkpoint_dirname(dirname)
    if step is None or not storage.exists(f"{dirname}/{QUARANTINE_MARKER_NAME}"):
        return False
    try:
        raw = storage.read_bytes(f"{dirname}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES)
        return Manifest.from_bytes(raw).step == step
    except CheckpointError:
        return False


def _not_quarantined_by_us(storage: Storage, dirname: str) -> str:
    """Why a quarantined-looking directory must not be deleted; empty when it may be."""
    record = read_quarantine_record(storage, dirname)
    if not record_matches(record, dirname) and not _in_place_of_own_step(storage, dirname):
        return "no QUARANTINED record written for this directory: not set aside by ckpt"
    try:
        foreign = ownership.strangers(storage.child(dirname).list_files())
    except CheckpointError as exc:
        return f"cannot list it ({exc})"
    if foreign:
        return f"it holds files this library did not write ({', '.join(foreign[:3])})"
    return ""


def _export_rank(text: str) -> int | str:
    if text == "mean":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a rank number >= 0 or 'mean'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a rank number >= 0 or 'mean'")
    return value


def cmd_export(args: argparse.Namespace) -> int:
    from ckpt.interop.export import describe, export, load_rename_table

    result = export(
        args.url,
        args.out,
        format=args.format,
        model_key=args.model_key,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        step=args.step,
        rename=load_rename_table(args.rename) if args.rename else None,
        config=args.config,
        progress=sys.stderr,
        rank=args.rank,
        unwrap=not args.keep_wrapper_names,
    )
    print("\n".join(shown(line) for line in describe(result).splitlines()))
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from ckpt.interop.pretrained import import_pretrained, is_pretrained_dir
    from ckpt.interop.stock_dcp import import_stock_dcp

    if is_pretrained_dir(args.source):
        if args.rename:
            raise ValueError(
                "--rename is for stock DCP checkpoints; a save_pretrained "
                "directory is one key, named by --model-key (default model)"
            )
        print(f"importing {shown(args.source)} (save_pretrained) ...", file=sys.stderr)
        result = import_pretrained(
            args.source,
            args.root,
            step=0 if args.step is None else args.step,
            model_key=args.model_key or "model",
            progress=sys.stderr,
        )
        return _imported(args, result)
    rename = {}
    for pair in args.rename or []:
        old, sep, new = pair.partition("=")
        if not (sep and old and new):
            raise ValueError(f"--rename {pair!r}: give OLD=NEW (top-level keys)")
        rename[old] = new
    print(f"importing {shown(args.source)} ...", file=sys.stderr)
    result = import_stock_dcp(
        args.source,
        args.root,
        step=args.step,
        rename=rename,
        model_key=args.model_key,
        progress=sys.stderr,
    )
    return _imported(args, result)


def _imported(args: argparse.Namespace, result: Any) -> int:
    """Verify (deep) what an import committed and say it."""
    storage, info = resolve(args.root, result.step)
    assert info.manifest is not None
    report = verify_dir(storage.child(info.dirname), info.manifest, mode=MODE_DEEP)
    print(
        f"imported {result.tensors} tensors ({human_bytes(result.tensor_bytes)}) and "
        f"{result.values} values from {shown(args.source)} as step {result.step}: "
        f"{shown(result.url)} ({'verified' if report.ok else 'VERIFY FAILED'})"
    )
    for key, why in result.left_out.items():
        print(f"left out     {shown(key)}: {why}")
    return EXIT_OK if report.ok else EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ckpt",
        description="Inspect and maintain checkpoints written by ckpt.save. URL is a checkpoint "
        "root (local path, file://, memory://, gs://bucket/prefix, s3://bucket/prefix) or one checkpoint directory.",
        epilog="Exit codes: 0 ok, 1 verification failed / nothing committed, 2 error.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log storage retries and details"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "ls",
        help="committed, damaged, partial, quarantined and foreign entries (links, stray "
        "files), newest first",
    )
    p.add_argument("url")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "verify",
        help="exit 0 if the newest (or given) checkpoint verifies, 1 if not",
        description="Check every file of a committed checkpoint against its manifest. "
        "Default: each file's size and crc32c; the crc32c is the one the backend reports "
        "for the object where it has one (GCS: nothing is downloaded), otherwise the file "
        "is read and checksummed (local files, file://, memory://). A file that is a "
        "symbolic link fails (links are never followed). Then .metadata is decoded with "
        "the loader a resume uses: an exact list of DCP's metadata classes, no code runs, "
        "every item inside a shard file the manifest lists, with a crc32c. OK means "
        "loadable. For a root, a damaged commit newer than its newest committed "
        "checkpoint (COMPLETE present, manifest.json damaged) is a FAIL too. A "
        "quarantined directory's URL (checkpoint_N.quarantined-STAMP) is checked against "
        "its own manifest.json, for forensics.",
    )
    p.add_argument("url")
    p.add_argument("--step", type=int, help="verify this step instead of the newest committed")
    depth = p.add_mutually_exclusive_group()
    depth.add_argument(
        "--fast",
        action="store_true",
        help="read nothing: sizes, plus the object crc32c where the backend reports one; "
        "on local files that is sizes only (the output says so)",
    )
    depth.add_argument(
        "--deep",
        action="store_true",
        help="read every file and check its crc32c, even where the backend reports one",
    )
    p.add_argument(
        "--finite",
        action="store_true",
        help="also read and decode every floating tensor (each item checked against its "
        "crc32c) and fail, naming them, if any holds NaN or inf. Off by default: it "
        "downloads every tensor (a save never commits non-finite values, so this is for "
        "checkpoints from elsewhere or saved with allow_non_finite)",
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("inspect", help="manifest summary: step, world size, bytes, tensors")
    p.add_argument("url")
    p.add_argument("--step", type=int, help="inspect this step instead of the newest committed")
    p.add_argument("--limit", type=int, default=40, help="tensors to list (default 40)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "gc",
        help="delete old checkpoints: keep the newest K and every N-th step; "
        "--quarantined deletes quarantined ones",
    )
    p.add_argument("url")
    p.add_argument(
        "--keep-last",
        type=int,
        metavar="K",
        help="keep the newest K committed (>= 1); required unless --quarantined",
    )
    p.add_argument(
        "--quarantined",
        action="store_true",
        help="delete the checkpoints resume set aside as corrupt (kept for forensics otherwise)",
    )
    p.add_argument(
        "--keep-every", type=int, metavar="N", help="also keep steps that are multiples of N"
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser(
        "export",
        help="write a checkpoint's model as Hugging Face safetensors or one torch file",
        description="Export the model part of one committed checkpoint (any world size, local "
        "or gs://) as consolidated weights: safetensors (OUT is a new directory: "
        "model.safetensors, or model-0000k-of-0000n.safetensors + model.safetensors.index.json "
        "past --max-shard-size) or torch (OUT is a new file: one torch.save of a flat state "
        "dict, held in memory whole). Every byte used is checked against the manifest's "
        "crc32c; tensors are streamed block by block; OUT appears only when complete "
        "(written as OUT.tmp-XXXXXXXX, then renamed). OUT must be a local path that does not "
        "exist.",
    )
    p.add_argument("url", help="checkpoint root (newest committed, or --step) or directory")
    p.add_argument("out", help="new local directory (safetensors) or file (torch)")
    p.add_argument("--format", choices=["safetensors", "torch"], default="safetensors")
    p.add_argument("--step", type=int, help="export this step instead of the newest committed")
    p.add_argument(
        "--model-key", default="model", help="the model's key in the saved state (default model)"
    )
    p.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating tensors (default: keep)"
    )
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="safetensors: largest file, e.g. 5GB (default), 500MB, 2GiB",
    )
    p.add_argument(
        "--rename",
        metavar="JSON",
        help='JSON file {"our.name": "their.name", "dropped.name": null}; unlisted names stay',
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="safetensors: copy FILE as OUT/config.json (default: the config and generation "
        "config the checkpoint recorded for a transformers model; without either, a warning: "
        "from_pretrained needs a config.json)",
    )
    p.add_argument(
        "--rank",
        type=_export_rank,
        default=0,
        metavar="R|mean",
        help="tensors the checkpoint holds per rank (BatchNorm statistics under DDP/FSDP2): "
        "write rank R's copy (default 0) or 'mean' for their average; said at WARNING",
    )
    p.add_argument(
        "--keep-wrapper-names",
        action="store_true",
        help="keep a wrapper's names as saved (default: a DDP/AveragedModel state loses its "
        "'module.' prefix and its n_averaged, so the export loads into the plain module)",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "import",
        help="make a stock DCP checkpoint (torchtitan's step-N, a dcp.save directory) or a "
        "Hugging Face save_pretrained directory one of ours",
        description="Read a checkpoint written by torch.distributed.checkpoint.save (.metadata "
        "and __<rank>_<n>.distcp files, no manifest), or a save_pretrained directory "
        "(model.safetensors or an index and its shards), in one process and save the state it "
        "holds under ROOT with ckpt.save: a committed checkpoint (manifest, crc32c, COMPLETE), "
        "verified, that loads on any world size. A stock checkpoint keeps its keys; a "
        "save_pretrained directory becomes the state of one key (--model-key, default model) "
        "at step 0 unless --step says otherwise. Its bytes are read as data (weights_only, "
        "safetensors headers checked against the files); a value that is not plain data is "
        "left out and named. SOURCE is not changed.",
    )
    p.add_argument(
        "source", help="the stock DCP or save_pretrained directory (local, gs://, s3://)"
    )
    p.add_argument("root", help="the checkpoint root of ours to save it under")
    p.add_argument(
        "--step", type=int, help="the step to save it as (default: the one its name says)"
    )
    p.add_argument(
        "--rename",
        action="append",
        metavar="OLD=NEW",
        help="rename a top-level key (repeatable), e.g. optimizer=optim: the keys the "
        "CheckpointManager that resumes it registers",
    )
    p.add_argument(
        "--model-key",
        metavar="KEY",
        help="put the top-level tensors under KEY (torchtitan saves the model's state "
        "flattened into the top level): --model-key model; for a save_pretrained directory "
        "the key of its tensors (default model)",
    )
    p.set_defaults(func=cmd_import)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; a password or signed query in a URL never reaches its output (a root URL
    is printed in most lines and in the error messages)."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactingStream(out), RedactingStream(err)
    try:
        return _main(argv)
    finally:
        sys.stdout, sys.stderr = out, err


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "gc" and args.keep_last is None and not args.quarantined:
        parser.error("gc needs --keep-last K, --quarantined, or both")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader gone before the last write shows here, not at exit
        return code
    except BrokenPipeError:
        # `python -m ckpt ls ROOT | head`: the reader left; exit quietly, as ls would.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except CheckpointNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
