"""Rotation files: reading, inspecting, checking and writing them, and the pairs they form.

Modules, lowest first (:mod:`tests.test_architecture` keeps the floors; ``docs/architecture.md`` has the table):

- :mod:`~.limits`: the bounds a file must keep and the tensor records checked against them;
- :mod:`~.archive`: a ``torch.save`` archive and its pickle, inspected before anything is loaded;
- :mod:`~.stheader`: a safetensors header, checked before any tensor is read;
- :mod:`~.schema`: what a rotation file may hold (versions, layouts, sizes), on records and on tensors;
- :mod:`~.rotation_set`: :class:`~.rotation_set.RotationSet`, one side of a pair, parsed from the authors' dict;
- :mod:`~.format`: reading and atomically writing ``.pt`` / safetensors rotation files;
- :mod:`~.validation`: orthogonality, finiteness, shapes, layers against the model;
- :mod:`~.latent`: MLA latent rotation files; :mod:`~.artefacts`: other files of the authors' tree by kind;
- :mod:`~.manifest`: the ``rotationzoo.json`` manifest a fit writes beside its files;
- :mod:`~.pairfile`: files holding a whole pair (safetensors pair file, GGUF rotation tensors);
- :mod:`~.localpair`: the pair of a folder, and verification of files and folders;
- :mod:`~.pair`: :class:`~.pair.RotationPair` and :func:`~.pair.resolve_pair` (a registry model is fetched);
- :mod:`~.calibrated`: pairs the authors' server fitted at start-up, imported into the cache;
- :mod:`~.derived`: files derived from verified pairs for an engine (the llama.cpp GGUF, split pair files).

This package imports nothing itself: importing one module never loads the others (the low modules sit
below the registry and the hub, :mod:`~.pair` above them).
"""
