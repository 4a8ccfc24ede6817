"""Planning a cluster run: each layout's memory per GPU, collectives and step time, from the real code traced.

``trace`` runs rank 0's micro-batch in a fake world of the cluster's size; ``record`` counts live
tensor bytes and collectives; ``deepspeed`` models DeepSpeed's share; ``price``, ``rank`` and
``search`` sum the pieces per layout; ``measure`` runs a layout for real on this CPU (the check).
"""
