"""The currency's definition (docs/design.md#normalisation): what one model unit is. Pure: the
database's models, the pricing rules and the gateways all read it from here.

R, the MU one replica of a model's reference GPU type mints per minute, is fixed by definition;
every cost model's `replica_mu_per_minute` starts from it (a non-reference GPU type's replicas
mint at an exchange rate, capacity.pricing.exchange).
"""

# R: MU per minute one replica of a model's reference GPU type mints, by definition.
REPLICA_MU_PER_MINUTE = 100.0
