"""Signal producers: node and cluster sources -> Kafka topics. Imports only schemas/."""
