"""Run launch/train.py once per case inside this one process, as ``python launch/train.py ARGS`` runs it
(``runpy`` with ``sys.argv`` set, ``SystemExit`` read as the exit status), so a corpus of configurations the
start-up gate refuses costs one interpreter start instead of one per case.

    python cli_batch.py launch/train.py cases.json results.json

cases.json: a list of argument lists. results.json (rewritten after every case, so a hang still leaves the
cases before it): a list of {"code": exit status or "traceback", "stderr": str, "seconds": float}.
"""
import contextlib
import io
import json
import runpy
import sys
import time
import traceback


def main(train: str, cases_path: str, out_path: str) -> None:
    with open(cases_path, encoding="utf-8") as fh:
        cases = json.load(fh)
    results = []
    for args in cases:
        err, start = io.StringIO(), time.monotonic()
        sys.argv = [train, *args]
        try:
            with contextlib.redirect_stderr(err):
                runpy.run_path(train, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - an escaped exception is what the corpus must never see
            code = "traceback"
            err.write(traceback.format_exc())
        results.append({"code": code, "stderr": err.getvalue(), "seconds": time.monotonic() - start})
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    main(*sys.argv[1:4])
