import json
import subprocess

from kvrunahead.search.plot import load_checkpoints


def test_plot_of_search_checkpoints(tmp_path):
    d = tmp_path / "table.search"
    d.mkdir()
    evals = [[[0, 512, 1024], 2.0], [[0, 600, 1024], 1.8], [[0, 700, 1024], 1.9]]
    (d / "1024.json").write_text(json.dumps({"evaluations": evals}))
    (d / "2048.json").write_text(json.dumps({"evaluations": [[[0, 1024, 2048], 5.0]]}))
    curves = load_checkpoints([d])
    assert list(curves) == ["1024", "2048"] and curves["1024"][1] == ([0, 600, 1024], 1.8)
    png = tmp_path / "curves.png"
    proc = subprocess.run(["python", "-m", "kvrunahead.search.plot", str(d), "-o", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert png.stat().st_size > 10_000


def test_plot_without_checkpoints_is_an_error(tmp_path):
    proc = subprocess.run(["python", "-m", "kvrunahead.search.plot", str(tmp_path), "-o", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no checkpoints" in proc.stderr and "Traceback" not in proc.stderr
