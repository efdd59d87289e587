"""One model over several processes: tensor parallelism with ``mx.distributed``, under ``mlx.launch``.

``kvmem serve --distributed`` runs one process per rank. Rank 0 is the whole
kvmem of one process (the gateway, the actors, the cache store) whose engine
and cache directory are wrapped; every other rank is a *follower* that only
repeats rank 0's engine calls on its own part of the model and keeps its own
part of every cache:

==============  ==============================================================
``shard``       the model split by mlx-lm's ``shard``, refused when its heads
                do not divide evenly; the tag a rank's caches carry
``wire``        the commands rank 0 sends and the replies it reads, framed
                msgpack over one TCP connection per follower
``leader``      rank 0: the connections, the handles that name caches on
                every rank, :class:`~runtime.distributed.leader.LeaderEngine`
``directory``   rank 0's cache directory: every save and load is also done by
                each follower on its own part; a part missing anywhere is a
                miss everywhere
``follower``    the loop every other rank runs
``launch``      joining the group, the connections' handshake, each rank's
                cache folder
==============  ==============================================================

Lockstep: a rank runs exactly the engine calls rank 0 runs, in the same order,
so the collectives inside each forward pass (mlx-lm's sharded layers
``all_sum`` after the attention output and the MLP) pair up. Rank 0 sends a
call before it makes it, never waits for a follower during engine work, and
greedy sampling picks the same token on every rank because the logits after the
last ``all_sum`` are the same. Sampling with a temperature draws from MLX's
random generator, which is per thread: rank 0 sends a seed with each model
load, and every rank seeds the thread that makes its engine calls with it.

Not handled: a rank that hangs or dies mid-call leaves the others waiting in a
collective (``mlx.launch`` stops every rank when one exits with an error); a
follower does its disk work between engine calls, so rank 0's next forward
pass waits for a follower's save.
"""
