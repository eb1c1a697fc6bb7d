"""The measuring core: the one way every number is taken.

Holds: `measure` (a step's peak, its categories, live memory, host peaks), `tracker` (the tensor counter behind the
trace and CPU measurements), `env` (the device, the T4's facts, emulation), `fileio` (files written whole), `report`
(a notebook's recorded results), `ranks` (worker processes), `isolation` (planning leaves the run as it was),
`wording` (the shape of every printout) and `console` (the libraries' notes kept off the console while the package
works: `quiet`).

May import: nothing else of the package (the layer at the bottom).
"""
