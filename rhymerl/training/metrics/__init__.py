"""The metrics room: a step's metrics as pure functions (step), the log and trace files (logger),
held-out evaluation (heldout) and the run's summary (summary)."""
from rhymerl.training.metrics.heldout import evaluate
from rhymerl.training.metrics.logger import MetricsLogger, append_trace, plot_run, read_metrics, truncate_trace
from rhymerl.training.metrics.step import StepFacts, StepTimes, async_metrics, merge_counts, step_metrics
from rhymerl.training.metrics.summary import print_summary, summarize, write_summary
