"""The built-in corpora: speech the framework synthesises itself, so that every feature can be tried on a fresh
machine with no download (the demo's data, as lhotse keeps its corpus recipes apart from its datasets).

- :mod:`~speechtrain.corpora.builtin`: ``builtin:<corpus>/<split>`` names, resolved to manifests built on first
  use; its command line builds a corpus ahead of a run.
- :mod:`~speechtrain.corpora.sentences`: the sentence generator (its vocabulary in ``sentence_tables.txt``).
- :mod:`~speechtrain.corpora.speech_corpus`: plans and renders the eSpeak NG and multi-engine corpora;
  :mod:`~speechtrain.corpora.engines`: the synthesisers it drives.
- :mod:`~speechtrain.corpora.dtmf`: a tiny DTMF-digit corpus for tests.

Nothing outside this package needs it except to resolve ``builtin:`` names; it imports only :mod:`speechtrain.common`.
"""
