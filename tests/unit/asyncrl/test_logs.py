"""A role that logs to a file shows an error's traceback there only; its console line names the file."""

import logging

from asyncrl.logs import setup_logging


def test_a_traceback_goes_to_the_file_and_the_console_gets_one_line(tmp_path, capsys):
    log_file = tmp_path / "role.log"
    log = setup_logging("role", "INFO", log_file)
    try:
        raise ValueError("bad input")
    except ValueError:
        log.exception("role failed: bad input")
    for handler in logging.getLogger().handlers:
        handler.flush()
    console = capsys.readouterr().err
    assert console.count("\n") == 1 and "role failed: bad input" in console and f"(traceback in {log_file})" in console
    written = log_file.read_text()
    assert "Traceback (most recent call last)" in written and "ValueError: bad input" in written
    logging.getLogger().handlers.clear()
