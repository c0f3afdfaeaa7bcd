"""Test machinery that ships with kvmerge, for its own tests, ``kvmerge bench``
and anyone checking a merge of their own.

``kvmerge.testing.reference`` is a naive, independent Python model of
``kvmerge.Merger``, written from docs/merge-rules.md: ``ReferenceMerger``,
``identity``, and the ``assert_same_events`` / ``assert_same_stats`` helpers.
It imports vLLM (for the event types) but neither pytest nor Hypothesis.
"""
