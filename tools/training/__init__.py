"""The demo models' training, one module per stage of ``tools/train_demo.py``.

Shared pieces: ``common`` (paths, seeds, settings), ``corpus`` (the stdlib text and
its token stream), ``tokenizer`` (the BPE and the chat tokenizer), ``models``
(configs, saving, checking a saved directory), ``loop`` (the schedule, the training
loop and its compiled step) and ``chat_data`` (chat batches and training on a fixed
system turn). Stages: ``prepare``, ``train``, ``finalize``, ``distill``,
``ship_distilled``, ``chat_prepare``, ``chat_drills``, ``chat_train``,
``chat_merge``, ``chat_distill``, ``mtp`` (``mtp-train`` and ``tools/train_mtp.py``)
and ``chat_ship``. Each stage module has ``run(args)``.

Not a package of segcache: ``tools/train_demo.py`` puts ``tools/`` on ``sys.path``.
"""
