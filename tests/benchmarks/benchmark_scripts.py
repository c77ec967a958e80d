"""The scripts of benchmarks/ as modules, for their smoke tests (importable from every test folder: tests/conftest.py
puts the folders on sys.path)."""
import importlib.util
import pathlib

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py imported as the module ``verl_ds_bench_<name>`` (a fresh one at each call)."""
    spec = importlib.util.spec_from_file_location(f"verl_ds_bench_{name}", BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
