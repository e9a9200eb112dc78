"""The README's run command, end to end, and its error path."""

import subprocess
import sys

from tidal.cli import main


def test_generate_answers_on_the_bundled_model():
    """With the layouts this machine picks: a question whose greedy answer the 8-bit rounding of
    the block layout leaves alone (France's is a near-tie there, as in llama.cpp)."""
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "generate", "What is the capital of Japan?",
                          "--max-tokens", "16", "--enforce-eager"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Tokyo" in out.stdout


def test_bad_parameter_is_a_clear_error(capsys):
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    assert "temperature must be a finite number >= 0" in capsys.readouterr().err


def test_bad_device_is_a_clear_error(capsys):
    assert main(["generate", "hi", "--device", "bogus"]) == 2
    assert "unknown device" in capsys.readouterr().err



def test_kv_cache_memory_sizes_the_cache(capsys):
    import argparse

    from tidal import cli

    parser = argparse.ArgumentParser()
    cli._engine_args(parser)
    args = parser.parse_args(["--kv-cache-memory", "0.25"])
    args.command = "generate"
    assert cli._engine_kwargs(args)["cache"].kv_cache_bytes == 1 << 28
    assert main(["generate", "hi", "--kv-cache-memory", "0"]) == 2
    assert "--kv-cache-memory must be a positive number of GiB" in capsys.readouterr().err
