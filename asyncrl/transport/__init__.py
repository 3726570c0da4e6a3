"""ZeroMQ transport between the roles: sockets, CURVE keys and the buffer's clients."""

from asyncrl.transport.clients import AdmissionClient, BufferConsumer
from asyncrl.transport.producer import TrajectoryProducer
from asyncrl.transport.sockets import BufferRequestError, BufferTimeout, RequestChannel, RestartWatch, generate_curve_keys

__all__ = ["AdmissionClient", "BufferConsumer", "BufferRequestError", "BufferTimeout", "RequestChannel",
           "RestartWatch", "TrajectoryProducer", "generate_curve_keys"]
