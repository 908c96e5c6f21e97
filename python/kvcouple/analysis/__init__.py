"""Analysis of trace stores (SPEC section 9): per (document, policy) RB-CMC estimates,
document-level bootstrap statistics, prespecified plans, and reports.

``kvcouple analyze STORE... --out DIR`` and ``kvcouple info STORE`` are the command line;
:func:`analyze` and :func:`write_report` are the Python API.
"""

from kvcouple.analysis.engine import AnalysisResult, Options, analyze
from kvcouple.analysis.plan import Plan, PlanError, load_plan
from kvcouple.analysis.report import DocumentFiles, write_report
from kvcouple.analysis.results import DocumentsReady

__all__ = [
    "AnalysisResult",
    "DocumentFiles",
    "DocumentsReady",
    "Options",
    "Plan",
    "PlanError",
    "analyze",
    "load_plan",
    "write_report",
]
