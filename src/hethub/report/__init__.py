"""Reports of a plan: pictures of the cluster and of one step, a Chrome trace and a Markdown summary.

Pure Python + matplotlib (Agg canvas, no display); never imports torch.
"""

from hethub.report.metrics import MeasuredRun, read_metrics
from hethub.report.writer import ReportPaths, write_report

__all__ = ["MeasuredRun", "ReportPaths", "read_metrics", "write_report"]
