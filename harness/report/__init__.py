"""Reports of runs: a SuiteRun as data (results_file.py: DIR/results.json), the printed report rendered from that
data alone (terminal.py), where the figures came from (provenance.py: versions, commit, time); `harness report
DIR` renders results directories as Markdown, JUnit XML and PNG plots (directory.py, junit.py, plots.py), and the
report stage handles a judged run's memray captures (artifacts.py). Nothing here imports the driver, the suites or
torch at module level."""
