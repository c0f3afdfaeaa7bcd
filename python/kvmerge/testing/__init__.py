"""Test machinery that ships with kvmerge (as ``polars.testing`` does), for its
own tests, the benchmarks and anyone checking a merge of their own.

``kvmerge.testing.reference`` is a naive, independent Python model of
``kvmerge.Merger``, written from docs/merge-rules.md: ``ReferenceMerger``,
``identity``, and the ``assert_same_events`` / ``assert_same_stats`` helpers.
It imports vLLM (for the event types) but neither pytest nor Hypothesis.
"""
