"""Write tests/long_tests.txt, the tests `-m 'not long'` deselects, from a full run's durations:

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 tests > durations.log
    .venv/bin/python tools/long_tests.py durations.log [--seconds 3]

A test is long when its call took at least --seconds (setup and teardown are the module's shared fixtures: they
run whichever of its tests is selected first)."""

import argparse
import pathlib
import re

HEADER = """\
# Tests deselected by -m 'not long' (the fast tier, README): each took {seconds:g} s or more of call time in a full
# run on the 2-core CI machine's equal (pytest --durations=0). conftest.py marks them; an id that no longer
# names a test fails the collection. Regenerate with tools/long_tests.py from a --durations=0 log.
"""
LINE = re.compile(r"\s*([\d.]+)s call\s+(tests/\S+\.py::.+?)\s*$")  # a parameter id may hold spaces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=pathlib.Path, help="pytest output with --durations=0")
    parser.add_argument("--seconds", type=float, default=3.0, help="the call time from which a test is long")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("tests/long_tests.txt"))
    args = parser.parse_args()
    long = sorted({m.group(2) for m in map(LINE.match, args.log.read_text().splitlines())
                   if m and float(m.group(1)) >= args.seconds})
    if not long:
        raise SystemExit(f"{args.log}: no 'call' durations of {args.seconds:g} s or more: run pytest with "
                         "--durations=0")
    args.out.write_text(HEADER.format(seconds=args.seconds) + "".join(f"{test}\n" for test in long))
    print(f"{args.out}: {len(long)} long tests")


if __name__ == "__main__":
    main()
