"""Run metrics shared by simulations and live replays: records, windows, goodput and run labels."""

from basin.evaluate.records import CallRecord, RunRecords, Sample, SessionRecord
from basin.evaluate.summary import Summary, Window, summarize, windows

__all__ = ["CallRecord", "RunRecords", "Sample", "SessionRecord", "Summary", "Window", "summarize", "windows"]
