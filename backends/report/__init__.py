"""The HTML report of a run directory: ``write_report(run_dir)``, ``backends report RUN_DIR``."""

from backends.report.page import REPORT_FILE, ReportError, ReportSummary, write_report

__all__ = ["REPORT_FILE", "ReportError", "ReportSummary", "write_report"]
