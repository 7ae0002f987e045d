"""Running the `specfork` CLI in-process from tests."""

import pytest

from specfork.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `specfork ARGV`."""
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err
