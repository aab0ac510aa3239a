"""webhooks: owners' endpoints, and the delivery of their events, signed"""
