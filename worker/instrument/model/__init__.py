"""The model socket: the only way an organism reaches a language model.

Owns, per generation, the socket server and its lifecycle (``server``), the provider-
neutral ABI and the capability manifest (``capabilities``) with the bounds it discloses
(``limits``), the HTTP framing (``framing``), the retrying, paid call (``engine``,
``call``, on the threads of ``threads``) and its audit (``audit``), the spending ledger
(``ledger``), the retry policy (``retry``), the cap on calls to a provider as an
interface with an in-process form (``throttle``; the fleet's shared form lives in
``worker.fleet``), the provider translations (``providers``) and their catalogue
(``catalogue``), prices (``prices``) and keys (``credentials``). The sandbox sees the
socket and the manifest; everything else stays on the trusted side. Importing this
package loads nothing: callers import the module they need.
"""
