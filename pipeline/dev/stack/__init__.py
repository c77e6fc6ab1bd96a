"""The system as services: the env file of the compose deployment (``secrets``) and the same topology as
local processes on 127.0.0.1 (``local``: ``make stack``, ``make stack-down`` and ``make ui``; ``ray_head``: the Ray
head of ``make stack RAY=1``)."""
