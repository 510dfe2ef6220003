"""The rehearsal: a 64-1024 GPU launch run on one CPU machine before it is paid for.

Every rank of the launch (or one of each alike class, ``ranks``) runs its real set-up and one
real training iteration through the training code (``runner``), over PyTorch's fake process
group, with every collective and point-to-point operation recorded with its group, peer,
shape, dtype and call site (``recorder``, ``records``). The checker (``checker``) proves the
ranks' operations fit together; the launch facts (``facts``) give each rank's parameters,
memory and communication per iteration, cross-checked against what the rehearsed ranks did.
``entry`` is what ``pretrain_gpt.py --rehearse`` and ``tools/rehearse.py`` run.
"""
